"""The fake SGLang server's wire, checked against the real `sglang` package (0.5.23).

The session's fake server records every request and reply; after this test has driven every
kind of call the plugin makes (plus a request SGLang must refuse), the sglang venv's python runs
tests/sglang_side/check_wire.py over the record: SGLang's generated contract
(`sglang/api/v1/api_types.py`) must decode each request and reply, refuse what the fake refused
with the same message, and its io_struct request classes must have the fields and defaults the
fake's control endpoints apply.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from plait.api import ModelInput, SamplingParams
from plait_testing.trainer import random_tokens

pytestmark = pytest.mark.sglang
CHECKER = Path(__file__).parent / "sglang_side" / "check_wire.py"


def test_fake_wire_matches_sglang_contract(
    make_attached, wire_log: Path, sglang_python: str, tmp_path: Path
) -> None:
    from plait_sglang.fake_server import CONTROL_BODIES, REQUIRED

    prompt = ModelInput.from_ints(random_tokens(1, 6, 151936))

    async def traffic() -> None:
        engine = make_attached()
        try:
            await engine.sample(
                prompt,
                2,
                SamplingParams(max_tokens=4, seed=1, temperature=0.8, top_k=20, top_p=0.9),
            )
            await engine.sample(prompt, 1, SamplingParams(max_tokens=3, stop=["a", "b"]))
            await engine.sample(prompt, 1, SamplingParams(max_tokens=3, stop=[11, 12]))
            await engine.sample(prompt, 1, SamplingParams(max_tokens=2, top_logprobs=2))
            await engine.compute_logprobs(prompt)
            await engine.weight_broadcast_ranks()
            await engine.set_weight_version(3)
            async with httpx.AsyncClient(base_url=engine.base_url) as client:
                refused = await client.post(
                    "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
                )
                assert refused.status_code == 400, "0.5.23 refuses sampling params it does not know"
                assert (
                    await client.post("/abort_request", json={"rid": "none-such"})
                ).status_code == 200
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(traffic(), 120))
    bodies = tmp_path / "control_bodies.json"
    bodies.write_text(
        json.dumps(
            {
                cls: {k: "<required>" if v is REQUIRED else v for k, v in fields.items()}
                for cls, fields in CONTROL_BODIES.items()
            }
        )
    )
    result = subprocess.run(
        [sglang_python, str(CHECKER), str(wire_log), str(bodies)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    for check in (
        "generate request + reply decode",
        "generate refusal message",
        "model_info reply decode",
        "server_info reply decode",
        "abort_request body decode",
        "control body fields/defaults",
    ):
        assert check in result.stdout
