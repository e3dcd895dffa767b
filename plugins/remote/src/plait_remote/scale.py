"""`plait scale RUN_DIR inference=N`: a running run's inference pool to N replicas.

The run's config (RUN_DIR/config.toml, written when it started) names the pool's `scale_file`;
the command writes `{"replicas": N}` there (atomically) and the pool, which reads it every
`poll_s` seconds, adds replicas (each given the newest weights before it serves) or drains the
newest ones (they finish their running requests, take no new ones, and leave).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from plait.errors import ConfigError

SCALABLE = ("inference",)


def scale_file_of(run_dir: Path) -> tuple[Path, float]:
    """(the scale file the run's inference pool reads, how often it reads it)."""
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError("RUN_DIR", f"{run_dir} holds no config.toml, so it is not a run's directory",
                          fix="give the directory `plait run` printed at its start (out_dir/name)")
    inference = tomllib.loads(config_path.read_text()).get("inference", {})
    if inference.get("engine") != "pool":
        raise ConfigError("inference.engine", f"the run in {run_dir} samples with {inference.get('engine')!r}, "
                                              "and only an inference pool scales",
                          fix='start the run with inference.engine = "pool" and inference.options.scale_file set')
    options = inference.get("options") or {}
    if not options.get("scale_file"):
        raise ConfigError("inference.options.scale_file", f"the inference pool of the run in {run_dir} reads no scale file",
                          fix=f'start the run with inference.options.scale_file = "{run_dir / "scale.json"}"')
    return Path(options["scale_file"]).expanduser(), float(options.get("poll_s", 1.0))


def scale(run_dir: Path, replicas: int) -> Path:
    """Ask the run's inference pool for `replicas` replicas; the scale file written."""
    if replicas < 1:
        raise ConfigError("inference", f"a pool needs at least one replica, asked for {replicas}",
                          fix="ask for 1 or more")
    path, _ = scale_file_of(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"replicas": replicas}))
    os.replace(partial, path)  # the pool never reads half a file
    return path
