"""A bounded fuzz of the ORS server: malformed and out-of-order requests, over real HTTP.

A hypothesis state machine sends session-lifecycle requests in any order, with valid, reused,
foreign and missing session ids, and bodies that are valid, subtly wrong or garbage (also hostile
JSON: integers past Python's 4300-digit limit, nesting up to 100,000 deep, NaN and overflowing
numbers, in bodies and in X-Secrets), plus requests to random paths with random methods, and
races of concurrent /create requests with one session id. After every request: no 5xx, no
redirect, no crash, and every 4xx says in its `detail` what was wrong; a `/call` that is
well-formed but names a bad tool or input answers in-band (`ok: false` with a message), as ORS
prescribes; of a race's creates at most one wins and the rest are 409s. After every run: no
session is left on the server, and every environment that was built was torn down.
"""

from __future__ import annotations

import base64
import json
import string
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, rule, run_state_machine_as_test

from plait_sdk import Environment, Server, ServerOptions, Split, TextBlock, ToolOutput, tool

MIN_REQUESTS = 2000
MIN_RACES = 50
RACERS = 4  # concurrent /create requests per race

pytestmark = pytest.mark.slow  # about 30 s: run with -m slow (CI does)


class Counts:
    lock = threading.Lock()
    built = 0
    torn_down = 0


class Fuzzed(Environment):
    """Accepts any task_spec; counts every instance built and torn down."""

    def __init__(self, task_spec: Any = None, secrets: Any = None) -> None:
        super().__init__(task_spec, secrets)
        with Counts.lock:
            Counts.built += 1

    def teardown(self) -> None:
        with Counts.lock:
            Counts.torn_down += 1

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train"), Split("test", "test")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"i": i} for i in range(3)]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(json.dumps(self.task_spec)[:200])]

    @tool
    def echo(self, text: str) -> ToolOutput:
        return ToolOutput(blocks=[TextBlock(text[:100])], reward=0.0)

    @tool
    def add(self, a: int, b: int) -> ToolOutput:
        return ToolOutput(blocks=[TextBlock(str(a + b))])

    @tool
    def finish(self) -> ToolOutput:
        return ToolOutput(blocks=[TextBlock("done")], reward=1.0, finished=True)


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
garbage_bytes = st.binary(max_size=64) | st.sampled_from(
    [b"{", b"[1,2", b"null", b"\xff\xfe", b'{"a":}', b"   "]
)
bad_index = st.sampled_from([-1, 3, 10**12, True, 1.5, "0", None])
known_paths = [
    "/health",
    "/version",
    "/list_environments",
    "/create_session",
    "/create",
    "/ping",
    "/delete",
    "/delete_session",
    "/fuzzed/splits",
    "/fuzzed/tasks",
    "/fuzzed/num_tasks",
    "/fuzzed/task",
    "/fuzzed/task_range",
    "/fuzzed/tools",
    "/fuzzed/task_tools",
    "/fuzzed/prompt",
    "/fuzzed/messages",
    "/fuzzed/call",
    "/fuzzed/score_group",
    "/prompt",
    "/call",
    "/nosuchenv/tools",
    "/nosuchenv/call",
]
any_sid = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=12)
session_routes = [
    "/fuzzed/prompt",
    "/fuzzed/messages",
    "/fuzzed/task_tools",
    "/prompt",
    "/task_tools",
]
body_routes = [
    "/create",
    "/fuzzed/call",
    "/fuzzed/score_group",
    "/fuzzed/tasks",
    "/fuzzed/num_tasks",
    "/fuzzed/task",
    "/fuzzed/task_range",
    "/call",
    "/task",
]
# JSON that Python's parser chokes on (or reads as infinity), or that nests beyond any sane body
huge_integer = st.integers(4301, 6000).map(lambda digits: b"-" + b"7" * digits)
deep_nesting = st.integers(101, 100_000).flatmap(
    lambda depth: st.sampled_from(
        [b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth]
    )
)
hostile_json = (
    huge_integer | deep_nesting | st.sampled_from([b"NaN", b"-Infinity", b"1e999", b"[1e400]"])
)


@pytest.fixture(scope="module")
def served() -> Any:
    server = Server([Fuzzed], options=ServerOptions(max_body_bytes=4096, setup_wait_s=5))
    with server.serve_in_thread() as url, httpx.Client(base_url=url, timeout=30) as client:
        yield server, client


def test_fuzz_malformed_and_out_of_order_requests(served: Any) -> None:
    server, client = served
    tally = {"requests": 0, "4xx": 0, "2xx": 0, "in_band_errors": 0, "races": 0, "hostile_json": 0}
    tally_lock = threading.Lock()
    racers = ThreadPoolExecutor(RACERS)

    def send(
        method: str,
        path: str,
        *,
        sid: str | None = None,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        malformed: bool = False,
    ) -> httpx.Response:
        all_headers = dict(headers or {})
        if sid is not None:
            all_headers["X-Session-ID"] = sid
        content = (
            raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        )
        response = client.request(method, path, content=content, headers=all_headers)
        with tally_lock:
            tally["requests"] += 1
        status = response.status_code
        where = f"{method} {path} sid={sid!r} body={(raw or content or b'')[:120]!r}"
        assert status < 500, f"{where} answered {status}: {response.text[:300]}"
        assert status < 300 or status >= 400, f"{where} answered {status} (a redirect)"
        if status >= 400:
            with tally_lock:
                tally["4xx"] += 1
            detail = response.json().get("detail")
            assert isinstance(detail, str) and len(detail) > 10, (
                f"{where}: 4xx without a message: {response.text}"
            )
        else:
            with tally_lock:
                tally["2xx"] += 1
            assert not malformed, (
                f"{where} was malformed but answered {status}: {response.text[:200]}"
            )
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                check_stream(where, response.text)
        return response

    def check_stream(where: str, text: str) -> None:
        events = [
            line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")
        ]
        assert events and events[0] == "task_id" and events[-1] in ("end", "error"), (
            f"{where}: bad stream {text!r}"
        )
        data = "".join(line[6:] for line in text.splitlines()[2:] if line.startswith("data: "))
        if events[-1] == "end" and data:
            result = json.loads(data)
            if "ok" in result and not result["ok"]:
                tally["in_band_errors"] += 1
                assert len(result["error"]) > 10 and result["reason"], (
                    f"{where}: in-band error without message"
                )

    class ServerMachine(RuleBasedStateMachine):
        reserved = Bundle("reserved")
        active = Bundle("active")

        def __init__(self) -> None:
            super().__init__()
            self.sids: set[str] = set()

        @rule(target=reserved)
        def create_session(self) -> str:
            text = send("POST", "/create_session").text
            sid = text.split("data: ")[1].split("\n")[0]
            self.sids.add(sid)
            return sid

        @rule(
            target=active,
            sid=reserved,
            index=st.integers(0, 2),
            by_spec=st.booleans(),
            spec=st.dictionaries(st.text(max_size=5), json_leaf, max_size=3),
        )
        def create(self, sid: str, index: int, by_spec: bool, spec: dict) -> str:
            body = (
                {"task_spec": spec}
                if by_spec
                else {"split": "train", "index": index, "env_name": "Fuzzed"}
            )
            send("POST", "/create", sid=sid, body=body)
            return sid

        @rule(target=active, sid=reserved, by_spec=st.booleans())
        def create_race(self, sid: str, by_spec: bool) -> str:
            body = {"task_spec": {"race": True}} if by_spec else {"split": "train", "index": 1}
            statuses = sorted(
                racers.map(
                    lambda _: send("POST", "/create", sid=sid, body=body).status_code, range(RACERS)
                )
            )
            tally["races"] += 1
            assert statuses in ([200] + [409] * (RACERS - 1), [409] * RACERS), (
                f"race on {sid!r}: {statuses}"
            )
            return sid

        @rule(
            path=st.sampled_from(body_routes),
            sid=st.one_of(active, any_sid),
            value=hostile_json,
            field=st.sampled_from(
                ["task_spec", "input", "split", "index", "start", "candidates", None]
            ),
        )
        def hostile_body(self, path: str, sid: str, value: bytes, field: str | None) -> None:
            raw = (
                value if field is None else b'{"name": "echo", "%s": %s}' % (field.encode(), value)
            )
            tally["hostile_json"] += 1
            send(
                "POST",
                path,
                sid=sid,
                raw=raw,
                headers={"Content-Type": "application/json"},
                malformed=True,
            )

        @rule(
            sid=reserved, value=hostile_json.filter(lambda v: len(v) < 12_000)
        )  # a header, not a body
        def hostile_secrets(self, sid: str, value: bytes) -> None:
            secrets = base64.b64encode(
                b'{"KEY": {"value": "v", "allowed_domains": %s}}' % value
            ).decode()
            tally["hostile_json"] += 1
            send(
                "POST",
                "/create",
                sid=sid,
                body={"task_spec": {}},
                headers={"X-Secrets": secrets},
                malformed=True,
            )

        @rule(
            sid=st.one_of(reserved, active, any_sid),
            body=st.one_of(
                st.fixed_dictionaries(
                    {"split": st.sampled_from(["train", "nope", ""]), "index": bad_index}
                ),
                st.fixed_dictionaries(
                    {"split": st.just("train"), "index": st.just(0), "task_spec": st.just({})}
                ),
                st.fixed_dictionaries(
                    {
                        "env_name": st.text(max_size=8).filter(lambda s: s.lower() != "fuzzed"),
                        "task_spec": st.just({}),
                    }
                ),
                st.fixed_dictionaries(
                    {"task_spec": st.just({}), "toolset_name": st.text(max_size=5)}
                ),
                st.dictionaries(st.text(max_size=8), json_value, max_size=3).filter(
                    lambda d: (
                        set(d)
                        - {"env_name", "task_spec", "split", "index", "secrets", "toolset_name"}
                    )
                ),
                json_value.filter(lambda v: not isinstance(v, dict)),
            ),
        )
        def create_malformed(self, sid: str, body: Any) -> None:
            send("POST", "/create", sid=sid, body=body, malformed=True)

        @rule(
            sid=active,
            name=st.sampled_from(["echo", "add", "finish", "nope", ""]),
            tool_input=st.one_of(
                st.just({"text": "hi"}),
                st.just({"a": 1, "b": 2}),
                st.just({}),
                st.dictionaries(st.text(max_size=5), json_value, max_size=3),
            ),
        )
        def call(self, sid: str, name: str, tool_input: dict) -> None:
            send("POST", "/fuzzed/call", sid=sid, body={"name": name, "input": tool_input})

        @rule(
            sid=st.one_of(active, reserved, st.just("no-such-session")),
            body=st.one_of(
                json_value.filter(lambda v: not isinstance(v, dict)),
                st.fixed_dictionaries(
                    {"name": json_value.filter(lambda v: not isinstance(v, str))}
                ),
                st.fixed_dictionaries(
                    {
                        "name": st.just("echo"),
                        "input": json_value.filter(lambda v: not isinstance(v, dict)),
                    }
                ),
                st.fixed_dictionaries(
                    {"name": st.just("echo"), "input": st.just({}), "task_id": st.text(max_size=12)}
                ),
            ),
        )
        def call_malformed(self, sid: str, body: Any) -> None:
            send("POST", "/fuzzed/call", sid=sid, body=body, malformed=True)

        @rule(
            sid=st.one_of(active, reserved, any_sid),
            route=st.sampled_from(session_routes),
            ping=st.booleans(),
        )
        def read_session(self, sid: str, route: str, ping: bool) -> None:
            if ping:
                send("POST", "/ping", sid=sid)
            else:
                send("GET", route, sid=sid)

        @rule(
            sid=st.one_of(active, reserved, st.just("never-made")),
            path=st.sampled_from(["/delete", "/delete_session"]),
        )
        def delete(self, sid: str, path: str) -> None:
            send("POST", path, sid=sid)

        @rule(
            route=st.sampled_from(
                [
                    "/fuzzed/prompt",
                    "/ping",
                    "/delete",
                    "/fuzzed/call",
                    "/create",
                    "/delete_session",
                    "/fuzzed/task_tools",
                ]
            )
        )
        def missing_session_header(self, route: str) -> None:
            method = "GET" if route.endswith(("prompt", "task_tools")) else "POST"
            send(
                method,
                route,
                body={"name": "echo", "input": {}} if route.endswith("call") else None,
                malformed=True,
            )

        @rule(
            path=st.sampled_from(
                [
                    "/fuzzed/tasks",
                    "/fuzzed/num_tasks",
                    "/fuzzed/task",
                    "/fuzzed/task_range",
                    "/tasks",
                    "/nosuchenv/task",
                ]
            ),
            body=st.one_of(
                json_value,
                st.fixed_dictionaries(
                    {
                        "split": st.sampled_from(["train", "x"]),
                        "index": bad_index,
                        "start": bad_index,
                    }
                ),
            ),
            raw=st.none() | garbage_bytes,
        )
        def task_queries(self, path: str, body: Any, raw: bytes | None) -> None:
            send("POST", path, body=body, raw=raw)

        @rule(
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
            path=st.one_of(
                st.sampled_from(known_paths),
                # one leading slash: httpx refuses to send a path that starts with "//"
                st.text(alphabet="abcz/_-.%", max_size=20).map(lambda p: "/" + p.lstrip("/")),
            ),
            raw=st.none() | garbage_bytes | st.just(b"x" * 5000),
            content_type=st.sampled_from(
                ["application/json", "text/plain", "", "multipart/form-data"]
            ),
        )
        def anything(self, method: str, path: str, raw: bytes | None, content_type: str) -> None:
            send(
                method,
                path,
                raw=raw,
                headers={"Content-Type": content_type} if content_type else None,
            )

        def teardown(self) -> None:
            for sid in self.sids:
                client.post("/delete_session", headers={"X-Session-ID": sid})

    run_state_machine_as_test(
        ServerMachine,
        settings=settings(
            max_examples=120,
            stateful_step_count=30,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    # How often the machine draws a race depends on the steps it happens to take; these races run
    # whatever it drew, so the race count the fuzz promises holds on every machine.
    for round_ in range(max(0, MIN_RACES - tally["races"])):
        sid = f"race-top-up-{round_}"
        statuses = sorted(
            racers.map(
                lambda _, sid=sid: (
                    send(
                        "POST", "/create", sid=sid, body={"split": "train", "index": 1}
                    ).status_code
                ),
                range(RACERS),
            )
        )
        tally["races"] += 1
        assert statuses == [200] + [409] * (RACERS - 1), f"race on {sid!r}: {statuses}"
        send("POST", "/delete_session", sid=sid)
    racers.shutdown()

    deadline_checks = 200
    while (server.sessions or Counts.built != Counts.torn_down) and deadline_checks:
        deadline_checks -= 1
        threading.Event().wait(0.05)
    assert client.get("/health").status_code == 200  # the server is alive after all that
    assert not server.sessions, f"leaked sessions: {sorted(server.sessions)}"
    assert Counts.built == Counts.torn_down, (
        f"built {Counts.built} environments, tore down {Counts.torn_down}"
    )
    print(f"fuzz: {tally}, environments built and torn down: {Counts.built}")
    assert tally["requests"] >= MIN_REQUESTS, tally
    assert tally["4xx"] >= MIN_REQUESTS // 2, tally
    assert tally["races"] >= MIN_RACES and tally["hostile_json"] >= 200, tally
