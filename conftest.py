"""For every test run from this repository: which tests share a pytest-xdist worker.

`scripts/test.sh` runs the slow half of the suite on two workers (`-n 2 --dist loadgroup`), so
that the two cores stay busy until both finish. A distribution's tests share session fixtures
that start servers (a vLLM server, a trainer service, the fake SGLang server, a Tinker service),
so they go to one worker as one group and each server starts once; the end-to-end tests under
tests/ share nothing and go one file a group. A test's own `xdist_group` mark wins.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent


def _group(path: Path) -> str:
    for folder in path.parents:
        if folder == REPOSITORY:
            break
        if (folder / "pyproject.toml").is_file():
            return folder.relative_to(REPOSITORY).as_posix()
    return path.relative_to(REPOSITORY).as_posix()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(Path(item.path))))
