"""Bradley–Terry reward models (plait_algorithms.reward_model): the pairwise loss and its gradient
against a hand-written reference, a training step as gradient descent on that loss (on plait-
testing's value model of one value per token, whose gradient is known), the pairs file's errors,
and the saved model scoring in the judge environment."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plait.api import (
    AdamParams,
    ConfigError,
    DataError,
    EpisodeConfig,
    Message,
    SamplingParams,
    blocks_text,
    build,
    run_episode,
)
from plait_algorithms.reward_model import (
    PreferencePair,
    RewardModel,
    RewardModelSettings,
    bradley_terry,
    build_reward_model,
    pair_step,
    parse_pair,
    read_pairs,
    train_reward_model,
)
from plait_testing.fakes import FIRST_LETTER, fake_model_dir
from plait_testing.replies import BytesRenderer, Replies

pytestmark = pytest.mark.usefixtures("fake_plugins")

LETTER = {c: FIRST_LETTER + ord(c) - ord("a") for c in "abcdefgh"}


def settings(tmp_path: Path, **more: Any) -> RewardModelSettings:
    model = fake_model_dir(tmp_path / "model")
    return RewardModelSettings(model=str(model), engine="fake.critic", renderer="fake", **more)


def reference_loss(chosen: np.ndarray, rejected: np.ndarray) -> float:
    """-log sigmoid(r_c - r_r), averaged, written out."""
    return float(
        np.mean(
            [-np.log(1 / (1 + np.exp(-(c - r)))) for c, r in zip(chosen, rejected, strict=True)]
        )
    )


def test_the_pairwise_loss_and_its_gradient_match_a_hand_written_reference() -> None:
    chosen, rejected = np.array([0.3, -1.2, 2.0, 0.0]), np.array([0.1, 0.4, -3.0, 0.0])
    loss, grad = bradley_terry(chosen, rejected)
    assert loss == pytest.approx(reference_loss(chosen, rejected), rel=1e-12)
    step = 1e-6
    for i in range(4):
        bumped = chosen.copy()
        bumped[i] += step
        numeric = (reference_loss(bumped, rejected) - reference_loss(chosen, rejected)) / step
        assert grad[i] == pytest.approx(numeric, rel=1e-4)
    assert bradley_terry(np.array([40.0]), np.array([-40.0]))[1][0] == pytest.approx(0.0)


def test_a_step_descends_the_pairwise_loss_gradient(tmp_path: Path) -> None:
    """The fake value model's score of a reply is the value of its last letter: one step at
    learning rate lr moves those values by -lr times the loss's gradient, read off by finite
    differences of the hand-written loss."""
    trainer, renderer = build_reward_model(settings(tmp_path))
    trainer.weights[:] = np.linspace(-0.5, 0.5, trainer.weights.size)
    pairs = [pair("ab", "cd", "ce"), pair("ab", "f", "cg"), pair("h", "dh", "c")]
    last = np.array([[LETTER[p.chosen[-1]], LETTER[p.rejected[-1]]] for p in pairs])
    before = trainer.weights.copy()

    def loss_at(weights: np.ndarray) -> float:
        return reference_loss(weights[last[:, 0]], weights[last[:, 1]])

    metrics = pair_step(trainer, renderer, pairs, AdamParams(learning_rate=0.5), 2)
    assert metrics["loss"] == pytest.approx(loss_at(before))
    assert metrics["accuracy"] == pytest.approx(np.mean(before[last[:, 0]] > before[last[:, 1]]))
    expected = before.copy()
    for letter in set(last.flat):
        bumped = before.copy()
        bumped[letter] += 1e-6
        expected[letter] -= 0.5 * (loss_at(bumped) - loss_at(before)) / 1e-6
    np.testing.assert_allclose(trainer.weights, expected, atol=1e-5)


def pair(prompt: str, chosen: str, rejected: str) -> PreferencePair:
    return PreferencePair((Message("user", prompt),), chosen, rejected)


def test_training_saves_a_model_that_scores_and_grades_in_the_judge(tmp_path: Path) -> None:
    """Pairs that prefer replies ending in "c" over those ending in "b": held-out accuracy goes
    from a coin flip to 1; the judge adds the saved model's score of the episode's answer to the
    task's prompt by weight."""
    pairs = [pair(x, f"{x}c", f"{x}b") for x in "adefgh"]
    out = tmp_path / "rm"
    manifest = train_reward_model(
        settings(tmp_path, steps=5, pairs_per_step=4, learning_rate=1.0, eval_every=2),
        pairs[:4],
        pairs[4:],
        out,
    )
    assert (manifest["held_out_accuracy_before"], manifest["held_out_accuracy"]) == (0.5, 1.0)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "held_out/accuracy" in r] == [2, 4, 5]

    model = RewardModel(out)
    assert model.score([Message("user", "a")], "c") > model.score([Message("user", "a")], "b")
    env = build(
        "env",
        "judge",
        options={
            "env": "fake.letters",
            "env_options": {"tasks": 4},
            "reward_model": str(out),
            "env_weight": 0.5,
            "judge_weight": 2.0,
        },
        options_path="env.options",
    )

    async def episode() -> tuple[Any, str]:
        task = await env.get_task("train", 1)
        session = await env.open(task)
        prompt = blocks_text(await session.prompt())
        await session.close()
        config = EpisodeConfig(SamplingParams(max_tokens=4), max_turns=1)
        played = await run_episode(env, task, Replies("c"), BytesRenderer(), config)
        await env.close()
        return played, prompt

    trajectory, prompt = asyncio.run(episode())
    judged = model.score([Message("user", prompt)], "c")
    assert trajectory.metrics == {"env/judge_score": judged, "env/reward/env": 1.0}
    assert trajectory.reward == pytest.approx(0.5 * 1.0 + 2.0 * judged)


def test_a_judge_takes_a_grader_or_a_reward_model_not_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a grader model or a reward_model, not both"):
        build(
            "env",
            "judge",
            options={"env": "fake.letters", "grader": {"model": "m"}, "reward_model": "dir"},
            options_path="env.options",
        )


def test_a_directory_without_a_reward_model_stops_the_judge_as_it_is_built(
    tmp_path: Path,
) -> None:
    with pytest.raises(DataError, match=r"has no reward_model\.json") as raised:
        build(
            "env",
            "judge",
            options={"env": "fake.letters", "reward_model": str(tmp_path)},
            options_path="env.options",
        )
    assert "plait reward-model train --out DIR" in (raised.value.fix or "")


def test_training_needs_pairs_held_out(tmp_path: Path) -> None:
    pairs = [pair("a", "ac", "ab")]
    with pytest.raises(DataError, match="got 1 and 0"):
        train_reward_model(settings(tmp_path), pairs, [], tmp_path / "rm")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not JSON"),
        ('["a"]', "a pair is a JSON object"),
        ('{"prompt": "p", "chosen": "a"}', "no 'rejected'"),
        ('{"prompt": "p", "chosen": 1, "rejected": "b"}', "'chosen' must be a string"),
        ('{"prompt": [{"content": "p"}], "chosen": "a", "rejected": "b"}', "need 'role'"),
        ('{"prompt": 3, "chosen": "a", "rejected": "b"}', "a string or a list of messages"),
    ],
)
def test_a_bad_pair_names_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n' + line + "\n")
    with pytest.raises(DataError, match=message) as raised:
        read_pairs(path)
    assert f"{path}:2" in raised.value.message


def test_pairs_take_a_prompt_as_text_or_messages(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert parse_pair({"prompt": messages, "chosen": "a", "rejected": "b"}, "x").prompt == (
        Message("system", "s"),
        Message("user", "u"),
    )
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no preference pairs"):
        read_pairs(tmp_path / "empty.jsonl")


def test_the_command_trains_saves_and_says_how_to_use_it(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from plait_algorithms.cli import reward_model_commands

    lines = [
        json.dumps({"prompt": x, "chosen": f"{x}c", "rejected": f"{x}b"}) for x in "abcdefghij"
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    model = fake_model_dir(tmp_path / "model")
    common = ["train", str(tmp_path / "pairs.jsonl"), "--model", str(model)]
    common += ["--engine", "fake.critic", "--renderer", "fake", "--learning-rate", "1"]
    done = CliRunner().invoke(
        reward_model_commands, [*common, "--out", str(tmp_path / "rm"), "--steps", "3"]
    )
    assert done.exit_code == 0, done.output
    assert "held-out pair accuracy (1 pairs): 0.500 -> 1.000" in done.output
    assert f'env.options.reward_model = "{tmp_path / "rm"}"' in done.output
    assert json.loads((tmp_path / "rm" / "reward_model.json").read_text())["pairs"] == 9

    refused = CliRunner().invoke(reward_model_commands, [*common, "--out", "x", "-o", "rank=8"])
    assert isinstance(refused.exception, ConfigError)
    assert "reward_model.options" in refused.exception.message

    (tmp_path / "few.jsonl").write_text("\n".join(lines[:3]) + "\n")
    few = ["train", str(tmp_path / "few.jsonl"), "--model", str(model), "--out", "x"]
    refused = CliRunner().invoke(reward_model_commands, few)
    assert refused.exit_code == 2 and "give --held-out pairs" in refused.output
