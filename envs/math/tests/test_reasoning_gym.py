"""`reasoning_gym`: a mixture of reasoning-gym datasets by weight, disjoint splits, rewards that
are reasoning-gym's own scores, and option errors that name the key."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from typing import Any

import pytest
import reasoning_gym
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from plait.api import ConfigError, Message, ToolOutput, build
from plait_sdk.testing import check_sdk_environment

MIXTURE = {"leg_counting": {"weight": 3}, "basic_arithmetic": {"config": {"max_terms": 3}}}


def make(**options: Any) -> Any:
    return build("env", "reasoning_gym", options={"datasets": MIXTURE, **options})


def tasks(env: Any, split: str) -> list[dict[str, Any]]:
    async def all_tasks() -> list[dict[str, Any]]:
        return [await env.get_task(split, i) for i in range(await env.num_tasks(split))]

    return asyncio.run(all_tasks())


def test_the_mixture_draws_datasets_by_weight_as_reasoning_gym_does() -> None:
    env = make(seed=7, train_size=400, test_size=40)
    train = tasks(env, "train")
    counts = Counter(task["dataset"] for task in train)
    assert set(counts) == {"leg_counting", "basic_arithmetic"}
    assert 0.68 < counts["leg_counting"] / 400 < 0.82  # weight 3 of 4
    own = reasoning_gym.create_dataset(
        "composite",
        size=400,
        seed=7,
        datasets=[
            DatasetSpec("leg_counting", 3.0, {}),
            DatasetSpec("basic_arithmetic", 1.0, {"max_terms": 3}),
        ],
    )
    assert [t["question"] for t in train] == [own[i]["question"] for i in range(400)]


def test_splits_are_disjoint_by_seed() -> None:
    env = build(
        "env",
        "reasoning_gym",
        options={"datasets": {"leg_counting": {}}, "seed": 3, "train_size": 200, "test_size": 50},
    )
    train, test = tasks(env, "train"), tasks(env, "test")
    # train item i comes from seed 3 + 1 + i, test item i from seed 3 + 200 + 1 + i
    seeded = [reasoning_gym.create_dataset("leg_counting", size=1, seed=s)[0] for s in (4, 204)]
    assert train[0]["question"] == seeded[0]["question"]
    assert test[0]["question"] == seeded[1]["question"]
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    with pytest.raises(IndexError, match="out of range"):  # it would reach the test seeds
        asyncio.run(env.get_task("train", 200))


def answer(env: Any, task: dict[str, Any], reply: str) -> ToolOutput:
    async def run() -> tuple[list[Message], Any]:
        session = await env.open(task)
        try:
            return await session.messages(), await session.call("final_answer", {"text": reply})
        finally:
            await session.close()

    messages, output = asyncio.run(run())
    assert messages == [
        Message("system", SYSTEM_PROMPTS["default"]),
        Message("user", task["question"]),
    ]
    assert isinstance(output, ToolOutput) and output.finished
    return output


def test_rewards_are_reasoning_gyms_scores() -> None:
    env = make(train_size=20)
    for task in tasks(env, "train")[:6]:
        # the composite seeds its j-th dataset with its seed (0) + j + 1
        seed = 1 + list(MIXTURE).index(task["dataset"])
        config = MIXTURE[task["dataset"]].get("config", {})
        dataset = reasoning_gym.create_dataset(task["dataset"], size=20, seed=seed, **config)
        entry = dataset[task["index"]]
        replies = [
            f"Thinking.\n<answer>{task['answer']}</answer>",  # right
            f"<answer>{task['answer']} legs</answer>",  # partly right: a partial score
            "<answer>-1</answer> or rather <answer>none</answer>",  # wrong (the last tag counts)
            f"It is {task['answer']}.",  # no answer tag
        ]
        rewards = [answer(env, task, reply).reward for reply in replies]
        assert rewards == [dataset.score_answer(extract_answer(reply), entry) for reply in replies]
        assert rewards[0] == 1.0 and 0.0 < rewards[1] < 1.0 and rewards[2:] == [0.0, 0.0]


def test_the_prompt_is_a_named_or_written_system_prompt_and_worked_examples() -> None:
    """`system_prompt` names one of reasoning-gym's or is the text itself; `few_shot` puts the
    first train items, answered in tags, before the question."""
    env = make(train_size=20, system_prompt="Answer in tags.", few_shot=2)
    task = asyncio.run(env.get_task("test", 3))
    first, second = tasks(env, "train")[:2]

    async def messages() -> list[Message]:
        session = await env.open(task)
        try:
            return await session.messages()
        finally:
            await session.close()

    assert asyncio.run(messages()) == [
        Message("system", "Answer in tags."),
        Message("user", first["question"]),
        Message("assistant", f"<answer>{first['answer']}</answer>"),
        Message("user", second["question"]),
        Message("assistant", f"<answer>{second['answer']}</answer>"),
        Message("user", task["question"]),
    ]


def test_a_scorer_that_raises_on_a_malformed_answer_gives_zero() -> None:
    env = build("env", "reasoning_gym", options={"datasets": {"prime_factorization": {}}})
    output = answer(env, asyncio.run(env.get_task("train", 0)), "<answer>garbage</answer>")
    assert output.reward == 0.0 and "ValueError" in output.metadata["scorer_error"]


def test_reasoning_gym_env_passes_the_sdk_contract_kit() -> None:
    env = make(train_size=20, test_size=5)
    report = check_sdk_environment(
        env.env_cls,
        reward_range=(0.0, 1.0),
        solve=lambda task: [("final_answer", {"text": f"<answer>{task['answer']}</answer>"})],
    )
    assert set(report.in_process.rewards) == {1.0}
    assert report.over_http is not None and set(report.over_http.rewards) == {1.0}


def config_error(datasets: Any, **options: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        build(
            "env",
            "reasoning_gym",
            options={"datasets": datasets, **options},
            options_path="env.options",
        )
    return caught.value.message


def test_bad_options_fail_naming_the_key_and_what_exists() -> None:
    message = config_error({"leg_countin": {}})
    assert message.startswith("config env.options: datasets.leg_countin: not a dataset of")
    assert 'did you mean "leg_counting"' in message and "basic_arithmetic, " in message
    message = config_error({"leg_counting": {"config": {"min_animal": 2}}})
    assert "datasets.leg_counting.config.min_animal: not a config key of leg_counting" in message
    assert "its keys: min_animals, max_animals, min_instances, max_instances" in message
    assert "set by plait" in config_error({"leg_counting": {"config": {"seed": 1}}})
    assert "reasoning-gym rejects it" in config_error(
        {"leg_counting": {"config": {"min_animals": 0}}}
    )
    assert "env.options.datasets.leg_counting.wieght: unknown key" in config_error(
        {"leg_counting": {"wieght": 2}}
    )
    assert "weight must be > 0" in config_error({"leg_counting": {"weight": 0}})
    assert "name at least one" in config_error({})
    assert "SYSTEM_PROMPTS: DeepSeekZero, default" in config_error(
        {"leg_counting": {}}, system_prompt="nope"
    )


def test_missing_reasoning_gym_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises
    assert "pip install reasoning-gym==0.1.25" in config_error({"leg_counting": {}})
