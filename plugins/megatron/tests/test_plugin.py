"""plait-megatron registers trainer.engine = "megatron"; finding it and validating its options
imports neither torch nor megatron-core."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DISCOVER = """
import json, sys
from plait.plugins import get_registry
entry = get_registry().get("trainer_engine", "megatron")
options = entry.options_class()()  # config validation builds one
loaded = [m for m in ("torch", "transformers", "megatron") if m in sys.modules]
print(json.dumps({"target": entry.target, "options": type(options).__name__, "loaded": loaded}))
"""


def test_registered_lazily() -> None:
    out = subprocess.run(
        [sys.executable, "-c", DISCOVER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {
        "target": "plait_megatron.engine:MegatronTrainer",
        "options": "MegatronOptions",
        "loaded": [],
    }


def test_options_name_the_bad_key() -> None:
    from plait.api import ConfigError, structure
    from plait_megatron.options import MegatronOptions

    assert (
        structure(
            MegatronOptions, {"attention": "sdpa", "spec": "local"}, "trainer.options"
        ).attention
        == "sdpa"
    )
    with pytest.raises(ConfigError, match=r"trainer\.options\.attention"):
        structure(MegatronOptions, {"attention": "flash"}, "trainer.options")
    with pytest.raises(ConfigError, match=r"trainer\.options: micro_batch_tokens must be > 0"):
        structure(MegatronOptions, {"micro_batch_tokens": 0}, "trainer.options")


def test_missing_megatron_core_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from plait.api import PluginError, ResolvedModel
    from plait_megatron.engine import MegatronTrainer

    monkeypatch.setitem(
        sys.modules, "megatron", None
    )  # import megatron.core now raises ImportError
    with pytest.raises(PluginError, match="needs megatron-core") as raised:
        MegatronTrainer(ResolvedModel("tiny", Path("/nonexistent"), Path("/nonexistent")))
    assert "plait-megatron[megatron]" in raised.value.fix
