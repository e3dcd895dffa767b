"""What a team sharing one server meets: a refused request never stalls the run's next one,
quotas hold under concurrent creates and answer at once, and sampling clients are released."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from plait_tinker.futures import Sequencer

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = pytest.mark.timeout(300)

PHRASE = [1000 + 37 * i for i in range(12)]


def sft(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture
def carol(tinker_url: str, quota_tenant: dict[str, Any]):
    """The tenant with quotas of 2 training runs and 4 sampling clients."""
    with tinker.ServiceClient(base_url=tinker_url, api_key=quota_tenant["api_key"]) as client:
        yield client


def test_a_settled_place_lets_the_next_request_go_at_once() -> None:
    asyncio.run(_settled_places())


async def _settled_places() -> None:
    sequencer = Sequencer(gap_s=30.0)
    ran: list[int] = []

    async def request(seq_id: int, hold: asyncio.Event | None = None) -> None:
        async with sequencer.turn(seq_id):
            ran.append(seq_id)
            if hold is not None:
                await hold.wait()

    third = asyncio.create_task(request(3))
    await request(1)
    sequencer.settle(2)  # refused before it was queued
    await asyncio.wait_for(third, 1.0)
    running = asyncio.Event()
    fourth = asyncio.create_task(request(4, running))
    sixth = asyncio.create_task(request(6))
    fifth = asyncio.create_task(request(5))
    await asyncio.sleep(0.01)
    fifth.cancel()  # its client went away while it waited: it settles too
    running.set()
    await asyncio.wait_for(asyncio.gather(fourth, sixth), 1.0)
    assert ran == [1, 3, 4, 6]


@pytest.mark.parametrize(
    "refuse, status, message",
    [
        (lambda run: run.save_state("bad/name"), 400, "plain name"),
        (lambda run: run.optim_step(types.AdamParams(learning_rate=-1.0)), 400, "learning_rate"),
        (lambda run: run.load_state("tinker://no-such-run/weights/x"), 404, "not found"),
        (lambda run: run.save_weights_external("x"), 404, "not served"),
    ],
    ids=["bad checkpoint name", "negative learning rate", "missing checkpoint", "not served"],
)
def test_the_request_after_a_refused_one_is_served_at_once(
    service_client, base_model: str, refuse, status: int, message: str
) -> None:
    """A refused request consumed a seq_id the server never queued: the next one must not wait
    for it (it waited 30 s)."""
    run = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    run.forward([sft(PHRASE)], "cross_entropy").result()  # loaded and warm
    began = time.monotonic()
    with pytest.raises(tinker.APIStatusError, match=message) as refused:
        refuse(run).result()
    assert refused.value.status_code == status
    run.forward([sft(PHRASE)], "cross_entropy").result()
    elapsed = time.monotonic() - began
    print(f"refusal {status} and the next forward: {elapsed:.2f} s")
    assert elapsed < 5.0, f"the next request waited {elapsed:.1f} s after a refusal"


def test_the_limits_are_settings_without_tenants(tmp_path) -> None:
    from plait.api import structure
    from plait_tinker.config import TinkerServerConfig
    from plait_tinker.service import TinkerService

    config = structure(
        TinkerServerConfig,
        {"models": {"m": {"model": "tiny-qwen3"}}, "server": {"max_training_runs": 1}},
    )
    service = TinkerService(config, tmp_path)
    anyone = service.tenant("tml-anything")
    assert service.limit(anyone, "max_training_runs") == 1
    assert service.limit(anyone, "max_sampling_sessions") == 64


def test_concurrent_creates_cannot_pass_the_quota(
    tinker_url: str, base_model: str, quota_tenant: dict[str, Any]
) -> None:
    headers = {"x-api-key": quota_tenant["api_key"]}

    async def main() -> tuple[list[int], list[str]]:
        async with httpx.AsyncClient(base_url=tinker_url, headers=headers, timeout=60) as http:
            session = (await http.post("/api/v1/create_session", json={})).json()["session_id"]
            creates = await asyncio.gather(
                *(
                    http.post(
                        "/api/v1/create_model",
                        json={
                            "session_id": session,
                            "model_seq_id": i,
                            "base_model": base_model,
                            "lora_config": {"rank": 4},
                        },
                    )
                    for i in range(20)
                )
            )
            messages = [r.json()["error"] for r in creates if r.status_code != 200]
            for response in creates:
                if response.status_code == 200:  # the admitted ones load
                    request_id = response.json()["request_id"]
                    while (
                        reply := await http.post(
                            "/api/v1/retrieve_future", json={"request_id": request_id}
                        )
                    ).status_code == 408:
                        pass
                    assert "model_id" in reply.json(), reply.json()
            await http.post(f"/api/v1/sessions/{session}/finish", json={})
            return [r.status_code for r in creates], messages

    statuses, messages = asyncio.run(main())
    assert statuses.count(200) == 2 and statuses.count(403) == 18, statuses
    assert "max_training_runs = 2" in messages[0]


def test_a_quota_refusal_reaches_the_caller_at_once_with_its_message(
    carol, base_model: str
) -> None:
    runs = [
        carol.create_lora_training_client(base_model=base_model, rank=4).result() for _ in range(2)
    ]
    began = time.monotonic()
    with pytest.raises(tinker.PermissionDeniedError, match="max_training_runs = 2"):
        carol.create_lora_training_client(base_model=base_model, rank=4).result()
    elapsed = time.monotonic() - began
    print(f"quota refusal reached the caller in {elapsed:.3f} s")
    assert elapsed < 5.0  # the SDK retried a 429 with backoff for 56 s
    assert runs[1].forward([sft(PHRASE)], "cross_entropy").result().loss_fn_outputs


def test_sampling_clients_are_released(
    tinker_url: str, tinker_server, base_model: str, quota_tenant: dict[str, Any]
) -> None:
    """200 sampling clients in a row, under a quota of 4: at the quota the least recently used
    idle one is released, a finished session releases its own, snapshots go with their
    weights."""
    app = tinker_server[1]
    held = lambda: sum(1 for s in app.service.samplers.values() if s.tenant == "carol")  # noqa: E731
    params = types.SamplingParams(max_tokens=2, temperature=1.0)
    prompt = types.ModelInput.from_ints(PHRASE[:4])
    with tinker.ServiceClient(base_url=tinker_url, api_key=quota_tenant["api_key"]) as client:
        samplers = [
            client.create_sampling_client(base_model=base_model).result() for _ in range(200)
        ]
        assert held() == 4
        assert len(samplers[-1].sample(prompt, 1, params).result().sequences) == 1
        with pytest.raises(tinker.NotFoundError, match="released"):
            samplers[0].sample(prompt, 1, params).result()
        run = client.create_lora_training_client(base_model=base_model, rank=4).result()
        for _ in range(8):
            snapshot = run.save_weights_and_get_sampling_client().result()
        assert len(snapshot.sample(prompt, 1, params).result().sequences) == 1
        assert held() <= 4
    for _ in range(10):  # a client each, closed
        with tinker.ServiceClient(base_url=tinker_url, api_key=quota_tenant["api_key"]) as client:
            sampler = client.create_sampling_client(base_model=base_model).result()
            sampler.sample(prompt, 1, params).result()
    assert held() == 0


SAMPLING_CLIENT = """
import sys, tinker
url, key, base = sys.argv[1:4]
client = tinker.ServiceClient(base_url=url, api_key=key)
run = client.create_lora_training_client(base_model=base, rank=4).result()
sampler = client.create_sampling_client(base_model=base).result()
params = tinker.types.SamplingParams(max_tokens=3000, temperature=1.0, stop=[])
future = sampler.sample(tinker.types.ModelInput.from_ints([1000, 1037]), 4, params)
print(run.model_id, flush=True)
future.result()
"""


def _cpu_rate(window_s: float) -> float:
    """Cores this process (the server's threads) used over the next `window_s`."""
    began, cpu = time.monotonic(), time.process_time()
    time.sleep(window_s)
    return (time.process_time() - cpu) / (time.monotonic() - began)


@pytest.mark.slow  # 15 s of sampling, killing and waiting: with the slow tests
def test_a_killed_clients_sampling_stops_and_its_runs_leave_the_quota(
    tinker_server, base_model: str, api_keys: dict[str, str]
) -> None:
    import subprocess
    import sys

    url, app = tinker_server
    client = subprocess.Popen(
        [sys.executable, "-c", SAMPLING_CLIENT, url, api_keys["bob"], base_model],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        run = client.stdout.readline().strip()  # type: ignore[union-attr]
        assert run.endswith(":train:0"), run
        time.sleep(1.0)
        busy = _cpu_rate(0.5)
    finally:
        client.kill()
        client.wait(30)
    killed = time.monotonic()
    while (rate := _cpu_rate(0.2)) > 0.1 * busy:
        assert time.monotonic() - killed < 10, f"still sampling at {rate:.2f} cores"
    stopped = time.monotonic() - killed
    while app.service.runs[run].engine is not None:
        assert time.monotonic() - killed < 20, "the killed client's run still holds its quota"
        time.sleep(0.1)
    unloaded = time.monotonic() - killed
    print(
        f"sampling at {busy:.2f} cores stopped {stopped:.2f} s after the kill; run unloaded "
        f"after {unloaded:.2f} s"
    )
    assert stopped < 3.0
    assert not any(s.tenant == "bob" for s in app.service.samplers.values())
