"""Run by the sglang venv's python (scripts/ci/sglang.sh), never by plait's: checks a fake SGLang
server's recorded wire traffic against the real `sglang` package.

    python check_wire.py WIRE.jsonl CONTROL_BODIES.json

- Every /generate request the server accepted decodes with SGLang 0.5.23's own contract
  (`sglang/api/v1/api_types.py`: GenerateRequest), and every reply with GenerateResponse;
  /model_info and /server_info replies with GetModelInfoResponse / GetServerInfoResponse;
  /abort_request bodies with AbortRequest.
- Every /generate request the server refused with 400 is refused by the contract too, with the
  same message.
- The control endpoints' request bodies (field names and defaults) equal SGLang's io_struct
  classes, read from `sglang/srt/managers/io_struct.py` without importing it (it needs GPU-only
  packages).

Prints one line per check and exits 1 on the first mismatch.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

REQUIRED = "<required>"


def sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the sglang package is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def load_api_types():
    path = sglang_dir() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def io_struct_fields() -> dict[str, dict[str, object]]:
    """class name -> field -> default (REQUIRED when none; repr of non-literal defaults)."""
    tree = ast.parse((sglang_dir() / "srt" / "managers" / "io_struct.py").read_text())
    classes: dict[str, dict[str, object]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, object] = {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                if item.value is None:
                    fields[item.target.id] = REQUIRED
                else:
                    try:
                        fields[item.target.id] = ast.literal_eval(item.value)
                    except ValueError:
                        fields[item.target.id] = ast.unparse(item.value)
        classes[node.name] = fields
    return classes


def main(wire_path: str, bodies_path: str) -> int:
    api = load_api_types()
    counts: dict[str, int] = {}

    def ok(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    for number, line in enumerate(Path(wire_path).read_text().splitlines(), 1):
        record = json.loads(line)
        path, request, status, reply = (
            record["path"],
            record["request"],
            record["status"],
            record["reply"],
        )
        where = f"wire record {number} ({path}, HTTP {status})"
        if path == "/generate":
            if status == 200:
                api.GenerateRequest.from_json_value(request)
                for item in reply if isinstance(reply, list) else [reply]:
                    api.GenerateResponse.from_json_value(item)
                ok("generate request + reply decode")
            elif status == 400 and isinstance(reply.get("error"), str):
                try:
                    api.GenerateRequest.from_json_value(request)
                except api.JsonContractError as exc:
                    if str(exc) != reply["error"]:
                        print(f"FAIL {where}: contract says {exc!s}, fake said {reply['error']}")
                        return 1
                    ok("generate refusal message")
                else:
                    print(f"FAIL {where}: the fake refused a request SGLang's contract accepts")
                    return 1
        elif path == "/model_info":
            api.GetModelInfoResponse.from_json_value(reply)
            ok("model_info reply decode")
        elif path == "/server_info":
            api.GetServerInfoResponse.from_json_value(reply)
            ok("server_info reply decode")
        elif path == "/abort_request":
            api.AbortRequest.from_json_value(request)
            ok("abort_request body decode")
    real = io_struct_fields()
    base = real["BaseReq"]
    for cls, fields in json.loads(Path(bodies_path).read_text()).items():
        expected = {**base, **real[cls]}
        got = {**{"rid": None, "http_worker_ipc": None}, **fields}
        if got != expected:
            print(f"FAIL control body {cls}: fake {got} != sglang {expected}")
            return 1
        ok("control body fields/defaults")
    for what, n in sorted(counts.items()):
        print(f"ok {n:4d} x {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
