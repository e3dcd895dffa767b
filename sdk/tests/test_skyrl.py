"""skyrl-gym's own environments (gsm8k, gsm8k_multi_turn) run in plait: episodes through plait's
rollout earn the rewards skyrl-gym gives the same replies; bad options fail naming the key."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym
from omegaconf import DictConfig
from skyrl_gym.envs.base_text_env import BaseTextEnv

from plait.api import (
    ConfigError,
    EpisodeConfig,
    SamplingParams,
    build,
    run_episode,
)
from plait_sdk.testing import check_sdk_environment
from plait_testing.replies import BytesRenderer, Replies

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May? Let's think step by step "
    'and output the final answer after "####".'
)


def row(env_class: str, answer: str, index: int) -> dict[str, Any]:
    """A row as SkyRL's gsm8k example writes them (examples/gsm8k/gsm8k_dataset.py)."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": QUESTION}],
        "env_class": env_class,
        "reward_spec": {"method": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def gsm8k_data(tmp_path: Path) -> dict[str, str]:
    return {
        "train": write_rows(
            tmp_path / "train.jsonl", [row("gsm8k", "72", 0), row("gsm8k", "5", 1)]
        ),
        "test": write_rows(tmp_path / "test.jsonl", [row("gsm8k", "10", 0)]),
    }


def skyrl_rewards(env_id: str, task: dict[str, Any], replies: Sequence[str], **extras: Any) -> list:
    """What skyrl-gym itself gives `replies` on `task`, stepped as SkyRL's generator does."""
    extras = {k: v for k, v in task.items() if k not in ("prompt", "env_class")} | extras
    env = skyrl_gym.make(env_id, env_config=DictConfig({}), extras=extras)
    env.init(task["prompt"])
    rewards = []
    for reply in replies:
        out = env.step(reply)
        rewards.append(out["reward"])
        if out["done"]:
            break
    return rewards


def play(env: Any, task: dict[str, Any], engine: Replies, max_turns: int = 1) -> Any:
    config = EpisodeConfig(SamplingParams(max_tokens=64), max_turns=max_turns)
    return asyncio.run(run_episode(env, task, engine, BytesRenderer(), config))


@pytest.mark.parametrize(
    ("reply", "reward"),
    [("48 + 24 = 72\n#### 72", 1.0), ("48 + 12 = 60\n#### 60", 0.0), ("It is 72.", 0.0)],
)
def test_gsm8k_episode_earns_skyrl_gyms_reward(
    gsm8k_data: dict[str, str], reply: str, reward: float
) -> None:
    env = build("env", "skyrl_gym", options={"env": "gsm8k", "data": gsm8k_data})
    task = asyncio.run(env.get_task("train", 0))
    engine = Replies(reply)
    trajectory = play(env, task, engine)
    assert engine.prompts == [f"user: {QUESTION}\n"]  # the row's prompt, as SkyRL sends it
    assert (
        list(trajectory.rewards) == skyrl_rewards("gsm8k", task, [reply], max_turns=1) == [reward]
    )
    assert trajectory.finished and trajectory.error is None


def test_multi_turn_episode_goes_on_until_skyrl_gym_says_done(tmp_path: Path) -> None:
    data = {"train": write_rows(tmp_path / "mt.jsonl", [row("gsm8k_multi_turn", "72", 0)])}
    env = build(
        "env", "skyrl_gym", options={"env": "gsm8k_multi_turn", "data": data, "max_turns": 3}
    )
    task = asyncio.run(env.get_task("train", 0))
    replies = ["#### 70", "#### 72"]
    engine = Replies(*replies)
    trajectory = play(env, task, engine, max_turns=3)
    expected = skyrl_rewards("gsm8k_multi_turn", task, replies, max_turns=3)
    assert list(trajectory.rewards) == expected == [0.2 / 3, 1.0]
    assert trajectory.finished and len(trajectory.turns) == 2
    # the observation of the first step is the user's next message
    assert (
        "assistant: #### 70\nuser: Please provide your step-by-step reasoning"
        in (engine.prompts[1])
    )


def test_skyrl_gym_env_passes_the_sdk_contract_kit(gsm8k_data: dict[str, str]) -> None:
    env = build("env", "skyrl_gym", options={"env": "gsm8k", "data": gsm8k_data})
    report = check_sdk_environment(
        env.env_cls,
        reward_range=(0.0, 1.0),
        solve=lambda task: [("reply", {"text": f"#### {task['reward_spec']['ground_truth']}"})],
    )
    assert set(report.in_process.rewards) == {1.0}
    assert report.over_http is not None and set(report.over_http.rewards) == {1.0}


def config_error(options: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        build("env", "skyrl_gym", options=options, options_path="env.options")
    return caught.value.message


def test_bad_options_fail_naming_the_key(gsm8k_data: dict[str, str], tmp_path: Path) -> None:
    message = config_error({"env": "gsm8", "data": gsm8k_data})
    assert message.startswith("config env.options: env: 'gsm8' is not a skyrl-gym environment")
    assert 'did you mean "gsm8k"' in message and "aime, gsm8k, gsm8k_multi_turn" in message
    missing = str(tmp_path / "nope.jsonl")
    assert f"data.test: no file {missing!r}" in config_error(
        {"env": "gsm8k", "data": {"test": missing}}
    )
    assert "env.options.max_turn: unknown key" in config_error(
        {"env": "gsm8k", "data": gsm8k_data, "max_turn": 2}
    )


def test_bad_rows_fail_naming_the_file_and_line(gsm8k_data: dict[str, str], tmp_path: Path) -> None:
    bad_prompt = {**row("gsm8k", "1", 0), "prompt": QUESTION}
    other_env = row("aime", "1", 1)
    for bad, problem in [(bad_prompt, "'prompt' must be a list"), (other_env, "'aime'")]:
        path = write_rows(tmp_path / "bad.jsonl", [row("gsm8k", "1", 0), bad])
        env = build("env", "skyrl_gym", options={"env": "gsm8k", "data": {"train": path}})
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{problem}"):
            asyncio.run(env.num_tasks("train"))


def test_missing_skyrl_gym_names_the_install(
    gsm8k_data: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym now raises
    message = config_error({"env": "gsm8k", "data": gsm8k_data})
    assert "pip install 'plait-sdk[skyrl]' (skyrl-gym==0.4.0)" in message


class _Broken(BaseTextEnv):
    """A skyrl-gym environment with bugs: its reward is not a number, or its step raises."""

    def __init__(self, env_config: Any = None, extras: Any = None) -> None:
        super().__init__()
        self.mode = (extras or {}).get("mode")

    def step(self, action: str) -> Any:
        if self.mode == "raise":
            raise RuntimeError("the grader crashed")
        return {"observations": [], "reward": "high", "done": True, "metadata": {}}


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            "reward",
            "skyrl-gym environment 'plait_test_broken' returned reward 'high', not a number",
        ),
        ("raise", "RuntimeError: the grader crashed"),
    ],
)
def test_an_environment_bug_costs_the_episode_and_says_what_it_was(
    tmp_path: Path, mode: str, message: str
) -> None:
    if "plait_test_broken" not in skyrl_gym.registry:
        skyrl_gym.register("plait_test_broken", entry_point=_Broken)
    data = {"train": write_rows(tmp_path / "rows.jsonl", [row("plait_test_broken", "1", 0)])}
    env = build("env", "skyrl_gym", options={"env": "plait_test_broken", "data": data})
    task = asyncio.run(env.get_task("train", 0))
    trajectory = play(env, {**task, "mode": mode}, Replies("one"))
    assert trajectory.error is not None and message in trajectory.error, trajectory.error
