"""What plait-torch registers, and that discovering it (and validating its options) imports no
torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_discovery_options_and_model_sources_import_no_torch() -> None:
    out = run_python("""
        import json, sys
        from plait.plugins import get_registry
        registry = get_registry()
        kinds = ("trainer_engine", "inference_engine", "model")
        found = {kind: registry.names(kind) for kind in kinds}
        for kind in ("trainer_engine", "inference_engine"):
            registry.get(kind, "torch").options_class()   # config validation loads these
        for name in ("smollm2-135m-instruct", "tiny-qwen3"):
            registry.get("model", name).load()              # resolving a name loads its ModelSource
        heavy = sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules)
        print(json.dumps({"found": found, "heavy": heavy}))
    """)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"imported {result['heavy']}"
    assert "torch" in result["found"]["trainer_engine"]
    assert "torch" in result["found"]["inference_engine"]
    assert {"smollm2-135m-instruct", "tiny-qwen3"} <= set(result["found"]["model"])


def test_options_are_validated_with_dotted_paths() -> None:
    from plait.api import ConfigError, structure
    from plait_torch.options import TorchInferenceOptions, TorchTrainerOptions

    assert (
        structure(
            TorchTrainerOptions,
            {"micro_batch_tokens": 512, "activation_checkpointing": True},
            "trainer.options",
        ).micro_batch_tokens
        == 512
    )
    with pytest.raises(
        ConfigError, match=r"trainer\.options\.micro_batch_token: unknown key .*did you mean"
    ):
        structure(TorchTrainerOptions, {"micro_batch_token": 512}, "trainer.options")
    with pytest.raises(ConfigError, match=r"inference\.options\.device"):
        structure(TorchInferenceOptions, {"device": "tpu"}, "inference.options")


def test_discovery_sets_openmp_waiting_before_torch_loads_and_keeps_the_users() -> None:
    code = """
        import json, os
        from plait.plugins import get_registry
        get_registry()
        print(json.dumps({k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "OMP_WAIT_POLICY": "ACTIVE",
        "GOMP_SPINCOUNT": "300000",
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1])["OMP_WAIT_POLICY"] == "PASSIVE"
