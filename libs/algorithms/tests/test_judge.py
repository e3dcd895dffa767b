"""The `judge` environment: the wrapped environment's episode, then a grader's score combined with
its reward by weights; a reply without a score costs the episode, the grader's engine failing
stops the run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from plait.api import (
    ConfigError,
    EngineError,
    EpisodeConfig,
    SamplingParams,
    build,
    run_episode,
)
from plait_algorithms.judge import parse_score
from plait_testing.replies import BytesRenderer, Replies

CONFIG = EpisodeConfig(SamplingParams(max_tokens=16), max_turns=1)


pytestmark = pytest.mark.usefixtures("fake_plugins")


def judge(**options: Any) -> Any:
    return build(
        "env",
        "judge",
        options={"env": "fake.letters", "env_options": {"tasks": 4}, **options},
        options_path="env.options",
    )


def play(env: Any, engine: Any) -> Any:
    async def episode() -> Any:
        task = await env.get_task("train", 1)
        return await run_episode(env, task, engine, BytesRenderer(), CONFIG)

    return asyncio.run(episode())


def test_the_grade_joins_the_environments_reward_by_weights() -> None:
    engine = Replies("c", "I would say Score: 7.")  # the policy's answer, then the grader's
    trajectory = play(judge(env_weight=0.5, judge_weight=2.0, rubric="Be strict."), engine)
    assert trajectory.error is None
    assert trajectory.rewards == (1.0, 0.7)
    assert trajectory.reward == pytest.approx(0.5 * 1.0 + 2.0 * 0.7)
    assert trajectory.metrics == {"env/judge_score": 0.7, "env/reward/env": 1.0}
    assert len(trajectory.turns) == 1  # the grader's reply trains nothing
    grader_prompt = engine.prompts[1]
    assert grader_prompt.startswith("system: Be strict.\nuser: Task:\ntask 1: answer with c")
    assert "Answer:\nc\n" in grader_prompt and "N from 0 to 10" in grader_prompt


def test_a_reply_without_a_score_in_range_costs_the_episode() -> None:
    for reply in ("It is fine.", "Score: 11", "Score: -1"):
        trajectory = play(judge(), Replies("c", reply))
        assert trajectory.error is not None and "has no 'Score: N'" in trajectory.error, reply
        assert "judge(fake.letters)" in trajectory.error


class _Broken(Replies):
    async def sample(self, *args: Any) -> Any:
        if not self.replies:
            raise EngineError("inference server crashed")
        return await super().sample(*args)


def test_the_graders_engine_failing_stops_the_run() -> None:
    with pytest.raises(EngineError, match="crashed"):
        play(judge(), _Broken("c"))


def test_an_environment_failure_is_not_graded() -> None:
    env = judge(env_options={"tasks": 4, "fail_fraction": 1.0})
    engine = Replies("c")
    trajectory = play(env, engine)
    assert trajectory.error is not None and len(engine.prompts) == 1


def test_parse_score_takes_the_last_score_in_range() -> None:
    assert parse_score("Score: 3 ... no, score = 8.5", 10) == 8.5
    assert parse_score("SCORE:1", 1) == 1.0
    assert parse_score("Score: 2", 1) is None
    assert parse_score("7/10", 10) is None


def test_bad_options_name_the_key() -> None:
    with pytest.raises(ConfigError, match="'scale' must be > 0"):
        judge(scale=0)
    with pytest.raises(ConfigError, match="env: name the environment to grade"):
        judge(env="judge")
    with pytest.raises(ConfigError, match=r"env\.options\.env_options"):
        judge(env_options={"taks": 4})


def test_another_model_grades_when_one_is_named(tmp_path: Any) -> None:
    """A grader of its own (plait-testing's fake engine and renderer on a model directory of
    their own: it writes letters, no score, which costs the episode); the policy's engine is
    asked only for the answer."""
    from plait_testing.fakes import fake_model_dir

    model = fake_model_dir(tmp_path / "grader")
    env = judge(grader={"model": str(model), "engine": "fake", "renderer": "fake"}, max_tokens=4)
    engine = Replies("c")
    trajectory = play(env, engine)
    assert len(engine.prompts) == 1
    assert trajectory.error is not None and "has no 'Score: N'" in trajectory.error
    asyncio.run(env.close())
