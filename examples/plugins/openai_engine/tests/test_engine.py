"""Fast tests, no vLLM: registration through the hooks, option validation, errors that name their
fix, and the wire and pause semantics against the fake server in conftest.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from plait.api import (
    ConfigError,
    DataError,
    EngineError,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightUpdate,
)
from plait_openai_engine.engine import OpenAIEngine, OpenAIOptions

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL = ResolvedModel("fake", Path("."), Path("."))  # the engine never reads the checkpoint
PROMPT = ModelInput.from_ints([1, 2, 3])


def run(url: str, body: Callable[[OpenAIEngine], Awaitable[Any]], **options: Any) -> Any:
    async def main() -> Any:
        engine = OpenAIEngine(MODEL, options=OpenAIOptions(url=url, **options), seed=0)
        try:
            return await asyncio.wait_for(body(engine), 30)
        finally:
            await engine.close()

    return asyncio.run(main())


# -- registration ----------------------------------------------------------------------------------

REGISTRY_PROBE = """
import json, sys
from plait.plugins import get_plugin_manager
pm = get_plugin_manager()
factory = pm.registry.get("inference_engine", "openai")
print(json.dumps({"plugin": factory.plugin, "target": factory.target, "options": factory.options,
                  "engine_imported": "plait_openai_engine.engine" in sys.modules}))
"""


def probe(env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", REGISTRY_PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_registers_through_the_hook_from_a_module_on_the_path() -> None:
    """PLAIT_PLUGIN_MODULES loads the plugin module without installing it (no other plugins)."""
    found = probe(
        {
            "PYTHONPATH": str(SRC),
            "PLAIT_PLUGINS": "none",
            "PLAIT_PLUGIN_MODULES": "plait_openai_engine.plugin",
        }
    )
    assert found == {
        "plugin": "plait_openai_engine.plugin",
        "target": "plait_openai_engine.engine:OpenAIEngine",
        "options": "plait_openai_engine.engine:OpenAIOptions",
        "engine_imported": False,
    }


def test_registers_through_its_entry_point_when_installed() -> None:
    from importlib.metadata import entry_points

    if not any(ep.name == "openai_engine" for ep in entry_points(group="plait")):
        pytest.skip(
            "plait-openai-engine is not installed (pip install -e examples/plugins/openai_engine)"
        )
    found = probe({"PLAIT_PLUGINS": "openai_engine"})
    assert found["plugin"] == "openai_engine" and not found["engine_imported"]


def test_options_are_validated_with_the_key_named() -> None:
    from plait.api import build

    with pytest.raises(
        ConfigError, match=r'inference\.options\.urll: unknown key \(did you mean "url"\?\)'
    ):
        build(
            "inference_engine",
            "openai",
            MODEL,
            options={"urll": "x"},
            options_path="inference.options",
            seed=0,
        )
    with pytest.raises(ConfigError, match="weight_version must be >= 0"):
        build("inference_engine", "openai", MODEL, options={"weight_version": -1}, seed=0)
    engine = build(
        "inference_engine",
        "openai",
        MODEL,
        options={"url": "http://h:1/", "weight_version": 7},
        seed=0,
    )
    assert (engine.url, engine.weight_version) == ("http://h:1", 7)


# -- errors ----------------------------------------------------------------------------------------


def test_an_unreachable_server_is_an_engine_error_naming_the_fix(unused_url: str) -> None:
    url = unused_url
    with pytest.raises(EngineError, match=f"cannot reach the server at {url}") as info:
        run(url, lambda e: e.sample(PROMPT, 1, SamplingParams(max_tokens=2)))
    assert "inference.options.url" in (info.value.fix or "")
    health = run(url, lambda e: e.health())
    assert not health.ok and "cannot reach" in health.detail


def test_apply_weights_says_the_engine_cannot_take_them(fake_server) -> None:
    with pytest.raises(EngineError, match="cannot take weight updates") as info:
        run(fake_server.url, lambda e: e.apply_weights(WeightUpdate(version=1, tensors={})))
    assert "inference.engine" in (info.value.fix or "")


def test_bad_requests_are_data_errors_with_the_server_message(fake_server) -> None:
    with pytest.raises(DataError, match="Token id 103 is out of vocabulary"):
        run(
            fake_server.url,
            lambda e: e.sample(ModelInput.from_ints([1, 103]), 1, SamplingParams(max_tokens=2)),
        )
    with pytest.raises(DataError, match="empty"):
        run(
            fake_server.url, lambda e: e.sample(ModelInput.empty(), 1, SamplingParams(max_tokens=2))
        )
    with pytest.raises(DataError, match="num_samples"):
        run(fake_server.url, lambda e: e.sample(PROMPT, 0, SamplingParams(max_tokens=2)))


# -- the wire --------------------------------------------------------------------------------------


def test_sample_sends_token_ids_and_reads_every_choice(fake_server) -> None:
    params = SamplingParams(max_tokens=4, seed=10, stop=[], top_k=5, temperature=0.5)
    response = run(fake_server.url, lambda e: e.sample(PROMPT, 2, params), weight_version=3)
    # token i of sample j: (sum(prompt) + seed + j + i) % 100
    assert [s.tokens for s in response.sequences] == [(16, 17, 18, 19), (17, 18, 19, 20)]
    assert all(s.logprobs == (-0.5,) * 4 and s.stop_reason == "length" for s in response.sequences)
    assert all(s.versions() == (3, 3, 3, 3) for s in response.sequences)
    sent = fake_server.requests[-1]
    assert sent["prompt"] == [1, 2, 3] and sent["model"] == "fake-model" and sent["stream"] is True
    assert (sent["n"], sent["seed"], sent["top_k"], sent["ignore_eos"], sent["logprobs"]) == (
        2,
        10,
        5,
        True,
        0,
    )


def test_max_tokens_none_fills_the_context_the_server_lists(fake_server) -> None:
    response = run(fake_server.url, lambda e: e.sample(PROMPT, 1, SamplingParams(stop=[])))
    assert (
        len(response.sequences[0].tokens) == 40 - 3 and fake_server.requests[-1]["max_tokens"] == 37
    )


def test_a_model_the_server_does_not_list_is_an_engine_error(fake_server) -> None:
    with pytest.raises(EngineError, match=r"lists \['fake-model'\], not other") as info:
        run(
            fake_server.url,
            lambda e: e.sample(PROMPT, 1, SamplingParams(max_tokens=1)),
            model="other",
        )
    assert "inference.options.model" in (info.value.fix or "")


def test_stop_token_ids_end_a_sample_with_reason_stop(fake_server) -> None:
    response = run(
        fake_server.url,
        lambda e: e.sample(PROMPT, 1, SamplingParams(max_tokens=8, seed=0, stop=[8])),
    )
    seq = response.sequences[0]
    assert seq.tokens == (6, 7, 8) and seq.stop_reason == "stop"
    assert fake_server.requests[-1]["stop_token_ids"] == [8]


def test_compute_logprobs_reads_the_echoed_prompt(fake_server) -> None:
    assert run(fake_server.url, lambda e: e.compute_logprobs(PROMPT)) == [
        None,
        pytest.approx(-0.2),
        pytest.approx(-0.3),
    ]


# -- pause / resume --------------------------------------------------------------------------------


async def started(engine: OpenAIEngine, max_tokens: int) -> asyncio.Task[Any]:
    """A long request that has received tokens when this returns."""
    task = asyncio.ensure_future(
        engine.sample(PROMPT, 2, SamplingParams(max_tokens=max_tokens, stop=[], seed=1))
    )
    await asyncio.sleep(0.3)
    return task


def test_pause_abort_returns_partial_samples_and_closes_the_streams(fake_server) -> None:
    async def body(engine: OpenAIEngine) -> None:
        long = await started(engine, 500)
        await engine.pause("abort")
        response = await long
        assert all(
            s.stop_reason == "abort" and 1 <= len(s.tokens) < 500 for s in response.sequences
        )
        later = asyncio.ensure_future(
            engine.sample(PROMPT, 1, SamplingParams(max_tokens=2, stop=[]))
        )
        await asyncio.sleep(0.3)
        assert not later.done() and fake_server.active == 0, "nothing runs while paused"
        await engine.resume()
        assert len((await later).sequences[0].tokens) == 2

    run(fake_server.url, body)
    assert fake_server.disconnects == 1  # the server saw the aborted stream go


def test_pause_keep_holds_samples_and_continues_them_after_resume(fake_server) -> None:
    async def body(engine: OpenAIEngine) -> None:
        long = await started(engine, 60)
        await engine.pause("keep")
        await asyncio.sleep(0.3)
        assert not long.done() and fake_server.active == 0, (
            "pause('keep') holds requests, and nothing runs"
        )
        await engine.resume()
        response = await long
        assert all(len(s.tokens) == 60 and s.stop_reason == "length" for s in response.sequences)
        # each unfinished sample went on from its own tokens, one request per sample
        continued = fake_server.requests[-2:]
        assert all(
            r["n"] == 1 and r["prompt"][:3] == [1, 2, 3] and len(r["prompt"]) > 3 for r in continued
        )
        assert sorted(len(r["prompt"]) - 3 + r["max_tokens"] for r in continued) == [60, 60]

    run(fake_server.url, body)


def test_pause_wait_lets_requests_finish_and_holds_new_ones(fake_server) -> None:
    async def body(engine: OpenAIEngine) -> None:
        long = await started(engine, 50)
        await engine.pause("wait")
        assert long.done() and all(len(s.tokens) == 50 for s in long.result().sequences)
        later = asyncio.ensure_future(
            engine.sample(PROMPT, 1, SamplingParams(max_tokens=2, stop=[]))
        )
        await asyncio.sleep(0.2)
        assert not later.done()
        await engine.resume()
        await later

    run(fake_server.url, body)
