"""For every test run from this repository: which tests share a pytest-xdist worker.

`scripts/test.sh` runs the tests on two workers with `--dist loadscope`, where the scope of a test
is, here, its distribution: a distribution's tests share session fixtures that start servers (a
vLLM server, a trainer service, the fake SGLang server, a Tinker service), so they go to one worker
as one unit and each server starts once. The end-to-end tests under tests/ share nothing and go one
file a unit. Units are handed out in collection order (with `--no-loadscope-reorder`), so a
command line that names the longest first keeps both workers busy to the end.

(Not `--dist loadgroup` with a mark per distribution: pytest 9.2 breaks it, pytest-xdist#1386.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPOSITORY = Path(__file__).resolve().parent


def distribution_of(nodeid: str) -> str:
    """The folder of the distribution a test belongs to, or its file for a test under tests/."""
    path = REPOSITORY / nodeid.split("::", 1)[0]
    for folder in path.parents:
        if folder == REPOSITORY:
            break
        if (folder / "pyproject.toml").is_file():
            return folder.relative_to(REPOSITORY).as_posix()
    return path.relative_to(REPOSITORY).as_posix()


# First: xdist's own implementation answers for every --dist, and it registers after this file.
@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByDistribution(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return distribution_of(nodeid)

    return ByDistribution(config, log)
