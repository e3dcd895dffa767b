"""`plait_hf.hub.from_hub_or`: the offline recipe where the hub does not answer, the hub's
snapshot where it does (huggingface.co cannot be reached from these machines, so that branch runs
against a stand-in for `snapshot_download`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait_hf import hub


@pytest.fixture(autouse=True)
def fresh_reachability():
    hub.hub_reachable.cache_clear()
    yield
    hub.hub_reachable.cache_clear()


def test_offline_the_recipe_builds_the_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    built: list[Path] = []
    hub.from_hub_or("org/model", built.append)(tmp_path)
    assert built == [tmp_path] and not hub.hub_reachable()


def test_where_the_hub_answers_it_downloads(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    downloads: list[tuple[str, str]] = []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo, local_dir: downloads.append((repo, local_dir)),
    )
    hub.from_hub_or("org/model", lambda dest: pytest.fail("built offline"))(tmp_path)
    assert downloads == [("org/model", str(tmp_path))]
