"""What plait-fsdp2 registers, and that discovering it (and validating its options) imports no
torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def test_discovery_and_options_import_no_torch() -> None:
    code = textwrap.dedent("""
        import json, sys
        from plait.plugins import get_registry
        registry = get_registry()
        registry.get("trainer_engine", "fsdp2").options_class()
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print(json.dumps({"found": registry.names("trainer_engine"), "heavy": heavy}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"imported {result['heavy']}"
    assert "fsdp2" in result["found"]


def test_options_are_validated_with_dotted_paths() -> None:
    from plait.api import ConfigError, structure
    from plait_fsdp2.options import FSDP2Options

    options = structure(
        FSDP2Options, {"world_size": 4, "activation_checkpointing": "selective"}, "trainer.options"
    )
    assert options.world_size == 4 and options.activation_checkpointing == "selective"
    with pytest.raises(ConfigError, match=r"trainer\.options\.activation_checkpointing: 'some'"):
        structure(FSDP2Options, {"activation_checkpointing": "some"}, "trainer.options")
    with pytest.raises(ConfigError, match=r"trainer\.options: world_size must be > 0"):
        structure(FSDP2Options, {"world_size": 0}, "trainer.options")
