"""What the judge's and the reward model's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from plait.plugins import get_plugin_manager


@pytest.fixture
def fake_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """plait-testing's fakes (fake.critic, the fake renderer, fake.letters) registered for the
    test only."""
    monkeypatch.setenv("PLAIT_PLUGIN_MODULES", "plait_testing.fakes")
    get_plugin_manager.cache_clear()
    yield
    monkeypatch.undo()
    get_plugin_manager.cache_clear()
