"""`plait serve online` in the small: the durable record and its replay, the feedback rules, and
the whole server in-process on the random tiny-qwen3 (answers carry their weight version, rewards
trigger updates through the gate, bad requests get 4xx). Learning, the gate catching a
regression, the load generator and SIGKILL are in tests/test_online.py."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from plait.api import ConfigError, SampledSequence, Turn, load_config
from plait_proxy.chat import RequestError
from plait_proxy.online import Feedback, OnlineOptions, online_options
from plait_proxy.online_log import ANSWERS, FEEDBACK, Answer, OnlineLog, replay


def answer(answer_id: str, version: int = 0, at: float | None = None) -> Answer:
    sequence = SampledSequence((5, 6), (-0.5, -0.25), "stop", weight_version=version)
    return Answer(
        answer_id, time.time() if at is None else at, version, (Turn((1, 2, 3), sequence),)
    )


def test_feedback_takes_each_reward_once_and_only_for_answers_it_holds(tmp_path: Path) -> None:
    async def go() -> None:
        feedback = Feedback(OnlineOptions(), OnlineLog(tmp_path))
        feedback.answered(answer("a"))
        feedback.answered(answer("b"))
        assert await feedback.reward("a", 1.0) == 1
        with pytest.raises(RequestError) as again:
            await feedback.reward("a", 0.0)
        assert again.value.status == 409
        with pytest.raises(RequestError) as unknown:
            await feedback.reward("zzz", 1.0)
        assert unknown.value.status == 404 and "feedback_timeout_s" in unknown.value.message
        assert await feedback.reward("b", 0.5) == 2
        batch, stale = await feedback.take(2, lambda a: True)
        assert [(a.id, a.reward) for a in batch] == [("a", 1.0), ("b", 0.5)] and not stale
        for name, version in [("c", 1), ("d", 5), ("e", 6)]:
            feedback.answered(answer(name, version))
            await feedback.reward(name, 1.0)
        batch, stale = await feedback.take(
            2, lambda a: a.version >= 5
        )  # stale ones are passed over
        assert (
            [a.id for a in batch] == ["d", "e"]
            and [a.id for a in stale] == ["c"]
            and not feedback.ready
        )

    asyncio.run(go())


def test_answers_waiting_past_the_timeout_are_dropped(tmp_path: Path) -> None:
    async def go() -> None:
        feedback = Feedback(OnlineOptions(feedback_timeout_s=60), OnlineLog(tmp_path))
        feedback.answered(answer("old", at=time.time() - 120))
        feedback.answered(answer("new"))
        assert list(feedback.waiting) == ["new"] and feedback.expired == 1
        with pytest.raises(RequestError) as late:
            await feedback.reward("old", 1.0)
        assert late.value.status == 404
        feedback.options = OnlineOptions(
            feedback_timeout_s=1e-3
        )  # no new answer comes: a reward still checks
        time.sleep(0.01)
        with pytest.raises(RequestError):
            await feedback.reward("new", 1.0)
        assert [a.id for a in replay(tmp_path, since=time.time() - 60).answers] == [
            "new"
        ]  # a restart neither

    asyncio.run(go())


def test_a_restart_gets_back_every_answer_and_reward_not_trained_on(tmp_path: Path) -> None:
    online_log = OnlineLog(tmp_path)
    for name in "abcd":
        online_log.answered(answer(name, version=3))
    online_log.rewarded("a", 1.0)
    online_log.rewarded("b", 0.0)
    online_log.rewarded("c", 1.0)
    online_log.updated({"update": 4, "version": 4, "ids": ["a"]})
    online_log.updated({"update": 4, "version": 4, "promoted": True, "score": 0.5})
    online_log.close()
    with (tmp_path / FEEDBACK).open("a") as f:  # a kill in the middle of a write
        f.write('{"id": "d", "rew')
    earlier = replay(tmp_path)
    assert earlier.updates == 4 and earlier.trained == {"a"} and earlier.rewarded == {"a", "b", "c"}
    assert [(a.id, a.reward) for a in earlier.answers] == [("b", 0.0), ("c", 1.0), ("d", None)]
    assert earlier.answers[0].turns == answer("b", version=3).turns  # token ids, logprobs, versions

    async def go() -> None:
        feedback = Feedback(OnlineOptions(), OnlineLog(tmp_path))
        assert feedback.restore(tmp_path).updates == 4
        assert (feedback.answers, feedback.feedback) == (4, 3)  # the status counts go on
        assert [a.id for a in feedback.ready] == ["b", "c"] and list(feedback.waiting) == ["d"]
        for done in ("a", "b"):
            with pytest.raises(RequestError):
                await feedback.reward(done, 1.0)
        await feedback.reward("d", 1.0)  # late feedback for an answer sent before the restart

    asyncio.run(go())
    assert [json.loads(line)["id"] for line in (tmp_path / FEEDBACK).read_text().splitlines()] == [
        "a",
        "b",
        "c",
        "d",
    ]
    lines = (tmp_path / ANSWERS).read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["turns"][0]["prompt"] == [1, 2, 3]


def test_online_options_are_checked_with_the_key_named() -> None:
    config = load_config(None, ["serve.online.batch_size=1"])
    with pytest.raises(ConfigError, match=r"serve\.online.*batch_size.*>= 2"):
        online_options(config)
    with pytest.raises(ConfigError, match=r"serve\.online\.batch"):
        online_options(load_config(None, ["serve.online.batch=4"]))
    assert online_options(load_config(None, ["serve.online.batch_size=4"])).batch_size == 4


def test_online_rl_refuses_the_inference_engines_kl_reference(tmp_path: Path) -> None:
    """Its episodes come through the proxy, which scores no reference: refused before any model
    loads."""
    from plait_proxy.app import ServeOptions
    from plait_proxy.online import online_server

    config = load_config(
        None,
        ["rl.kl={coef=0.1, reference='inference'}", f"run.out_dir={json.dumps(str(tmp_path))}"],
    )

    async def go() -> None:
        async with online_server(config, ServeOptions(port=0, api_key="k")):
            pass

    with pytest.raises(ConfigError, match="scores only the run loop's") as info:
        asyncio.run(go())
    assert info.value.path == "rl.kl.reference"


@pytest.mark.slow  # 19 s of training through the gate and a restart: kept out of make check
@pytest.mark.timeout(600)
def test_the_server_answers_records_and_updates_through_the_gate(
    tiny_qwen3: Any, tmp_path: Path
) -> None:
    pytest.importorskip("plait_math", reason="the gate's held-out tasks come from math.arith")
    from plait_proxy.app import ServeOptions
    from plait_proxy.online import online_server

    config = load_config(
        None,
        [
            f"model.name={json.dumps(str(tiny_qwen3.path))}",
            "trainer.engine=torch",
            "inference.engine=torch",
            "renderer.name=chat_template",
            "env.name=math.arith",
            'env.options={preset="tiny"}',
            "eval.tasks=4",
            "eval.samples_per_task=1",
            "serve.online.batch_size=2",
            f"run.out_dir={json.dumps(str(tmp_path))}",
            'metrics.sinks=["jsonl"]',
            "run.name=online",
        ],
    )
    chat = {
        "model": str(tiny_qwen3.path),
        "messages": [{"role": "user", "content": "What is 2+3?"}],
        "max_tokens": 4,
    }
    ids: list[str] = []

    async def go() -> None:
        async with (
            online_server(config, ServeOptions(port=0, api_key="k")) as (url, server),
            httpx.AsyncClient(
                base_url=url, timeout=120, headers={"authorization": "Bearer k"}
            ) as client,
        ):
            replies = [await client.post("/v1/chat/completions", json=chat) for _ in range(4)]
            assert all(r.status_code == 200 for r in replies), replies[0].text
            ids.extend(r.json()["id"] for r in replies)
            assert [r.headers["x-plait-weight-version"] for r in replies] == ["0"] * 4
            assert [r.json()["plait"]["response_id"] for r in replies] == [
                r.headers["x-plait-response-id"] for r in replies
            ]
            assert len(server.feedback.waiting) == 4
            assert (
                await client.get("/v1/online/status", headers={"authorization": "Bearer no"})
            ).status_code == 401
            for body, status in [
                ({"response_id": ids[0], "reward": "1"}, 400),
                ({"response_id": ids[0]}, 400),
                ({"response_id": ids[0], "reward": float("inf")}, 400),
                ({"reward": 1}, 400),
                ({"response_id": "chatcmpl-nope", "reward": 1}, 404),
            ]:
                reply = await client.post("/v1/feedback", content=json.dumps(body))
                assert reply.status_code == status, (body, reply.text)
                assert reply.json()["error"]["message"]
            for i, response_id in enumerate(ids):
                reply = await client.post(
                    "/v1/feedback", json={"response_id": response_id, "reward": float(i % 2)}
                )
                assert reply.status_code == 200, reply.text
            assert (
                await client.post("/v1/feedback", json={"response_id": ids[0], "reward": 1})
            ).status_code == 409
            assert (
                await client.post("/v1/online/settings", json={"learning_rate": -1})
            ).status_code == 400
            status = await wait_for_updates(client, 2)
            assert status["updates"] == 2 and status["answers"] == 4 and status["feedback"] == 4
            assert all(e["promoted"] for e in status["events"])  # a held-out score of 0 never falls
            assert status["serving_version"] == status["trainer_version"] == 2
            task = {"prompt": "What is 2+3?", "answer": "5", "answer_format": "plain"}
            judged = [
                await client.post(
                    "/v1/chat/completions", json=chat, headers={"x-plait-task": json.dumps(task)}
                )
                for _ in range(2)
            ]
            assert [r.headers["x-plait-weight-version"] for r in judged] == ["2", "2"]
            status = await wait_for_updates(
                client, 3
            )  # the environment's rewards, no feedback posted
            assert status["feedback"] == 6 and status["judge_errors"] == 0
            assert (
                status["events"][-1]["promoted"] is False
            )  # both 0: no signal, no step, nothing to gate
            for header, status_code in [("{", 400), ("[1]", 400), (json.dumps({"prompt": 1}), 200)]:
                reply = await client.post(
                    "/v1/chat/completions", json=chat, headers={"x-plait-task": header}
                )
                assert reply.status_code == status_code, reply.text
            for _ in range(
                100
            ):  # a task the environment refuses costs that answer its reward, nothing else
                if (await client.get("/v1/online/status")).json()["judge_errors"] == 1:
                    break
                await asyncio.sleep(0.1)
            assert (await client.get("/v1/online/status")).json()["judge_errors"] == 1
            assert not server.feedback.waiting.keys() & set(ids)

            trainer = server.policy.trainer
            step = trainer.optim_step

            def failing_step(*args: Any) -> Any:  # the trainer fails once, mid-update
                trainer.optim_step = step
                raise RuntimeError("out of memory")

            trainer.optim_step = failing_step
            await answer_and_reward(client, chat, [0.0, 1.0])
            status = await wait_for_updates(client, 4)
            assert status["failed_updates"] == 1 and status["learning"] == "running"
            assert status["trainer_version"] == status["serving_version"] == 2
            await answer_and_reward(client, chat, [0.0, 1.0])
            status = await wait_for_updates(client, 5)  # and the next update goes through
            assert status["serving_version"] == 3

            session = {
                "x-plait-session": "conversation"
            }  # an answer trains the conversation behind it
            first = (await client.post("/v1/chat/completions", json=chat, headers=session)).json()
            follow_up = {
                **chat,
                "messages": [
                    *chat["messages"],
                    first["choices"][0]["message"],
                    {"role": "user", "content": "And 3+4?"},
                ],
            }
            second = (
                await client.post("/v1/chat/completions", json=follow_up, headers=session)
            ).json()
            other = (await client.post("/v1/chat/completions", json=chat, headers=session)).json()
            waiting = server.feedback.waiting
            assert [
                len(waiting[r["plait"]["response_id"]].turns) for r in (first, second, other)
            ] == [1, 2, 1]
            statuses.append((await client.get("/v1/online/status")).json())

    async def restarted() -> None:
        async with (
            online_server(config, ServeOptions(port=0, api_key="k")) as (url, _),
            httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer k"}) as client,
        ):
            statuses.append((await client.get("/v1/online/status")).json())

    statuses: list[dict[str, Any]] = []
    asyncio.run(asyncio.wait_for(go(), 580))
    asyncio.run(asyncio.wait_for(restarted(), 300))
    counts = ["answers", "feedback", "updates", "promotions", "rejections", "rollbacks"]
    counts += ["failed_updates", "dropped_stale"]
    before, after = ({key: status[key] for key in counts} for status in statuses)
    assert before == after and before["answers"] == 14 and before["promotions"] == 3
    assert [e["update"] for e in statuses[1]["events"]] == [1, 2, 3, 5]
    metrics = [
        json.loads(line)
        for line in (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3, 5]
    assert [m.get("gate/promoted") for m in metrics] == [1.0, 1.0, None, 1.0]
    updates = [
        json.loads(line)
        for line in (tmp_path / "online" / "online" / "updates.jsonl").read_text().splitlines()
    ]
    consumed = [u["ids"] for u in updates if "ids" in u]
    assert sorted(i for batch in consumed[:2] for i in batch) == sorted(
        r[len("chatcmpl-") :] for r in ids
    )
    assert [u["promoted"] for u in updates if "promoted" in u] == [True, True, False, False, True]


async def answer_and_reward(
    client: httpx.AsyncClient, chat: dict[str, Any], rewards: list[float]
) -> None:
    for reward in rewards:
        reply = await client.post("/v1/chat/completions", json=chat)
        feedback = await client.post(
            "/v1/feedback", json={"response_id": reply.json()["id"], "reward": reward}
        )
        assert feedback.status_code == 200, feedback.text


async def wait_for_updates(client: httpx.AsyncClient, updates: int) -> dict[str, Any]:
    for _ in range(600):
        status = (await client.get("/v1/online/status")).json()
        if (
            status["updates"] >= updates
            and len(status["events"]) + status["failed_updates"] == status["updates"]
        ):
            return status
        await asyncio.sleep(0.2)
    raise AssertionError(f"{updates} updates did not come: {status}")
