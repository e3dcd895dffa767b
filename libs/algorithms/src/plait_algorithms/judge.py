"""`judge`: any environment's episodes, graded again by a model against a rubric.

`env.name = "judge"` wraps the environment `env` (with `env_options`). Each episode runs in it
as usual; then a grader model is shown the rubric, the task's prompt and the episode's final
answer, and asked for `Score: N` (0 <= N <= `scale`). The episode's reward becomes
`env_weight * (the environment's reward) + judge_weight * N / scale`; the judged score is
reported as `env/judge_score` and the environment's own reward as `env/reward/env`.

The grader is the policy's own inference engine and renderer (greedy, a seed per episode), or
another model (`grader = { model = ..., engine = "torch", renderer = "chat_template" }`, built
on first use). Its reply trains nothing. A reply without a score in range costs the episode, as
an environment failure does; the grader's engine or renderer failing is plait's own failure and
stops the run.

Or a Bradley–Terry reward model grades (`reward_model = "DIR"`, what `plait reward-model train`
wrote; `plait_algorithms.reward_model`): the judged score is then its score of the answer as the
reply to the task's prompt, a real number (a preference logit; rubric and scale are not used).
"""

from __future__ import annotations

import asyncio
import math
import re
import zlib
from collections.abc import Mapping
from typing import Any

import attrs

from plait.api import (
    EpisodeConfig,
    InferenceEngine,
    Message,
    Renderer,
    SamplingParams,
    Split,
    Trajectory,
    blocks_text,
    build,
    get_registry,
    resolve_model,
    run_episode,
)
from plait_algorithms.reward_model import RewardModel

DEFAULT_RUBRIC = (
    "You grade answers. Read the task and the answer, judge how well the answer solves the "
    "task, and reply with one line: 'Score: N'."
)
SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def _finite(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


@attrs.frozen(kw_only=True)
class GraderOptions:
    """Another model as the grader (default: the policy's own engine and renderer)."""

    model: str
    engine: str = "torch"
    renderer: str = "chat_template"


@attrs.frozen(kw_only=True)
class JudgeOptions:
    env: str
    """The environment whose episodes are graded (a registered name)."""
    env_options: dict[str, Any] = attrs.field(factory=dict)
    rubric: str = DEFAULT_RUBRIC
    """The grader's instructions (its system message)."""
    scale: float = attrs.field(default=10.0, validator=[_finite, attrs.validators.gt(0)])
    """The highest score the grader may give."""
    env_weight: float = attrs.field(default=1.0, validator=_finite)
    judge_weight: float = attrs.field(default=1.0, validator=_finite)
    max_tokens: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    """The grader's reply length."""
    grader: GraderOptions | None = None
    reward_model: str | None = None
    """A reward model's directory (`plait reward-model train --out DIR`) to grade instead."""

    def __attrs_post_init__(self) -> None:
        if self.env == "judge":
            raise ValueError("env: name the environment to grade, not judge itself")
        if self.grader is not None and self.reward_model is not None:
            raise ValueError("grader: give a grader model or a reward_model, not both")


def parse_score(reply: str, scale: float) -> float | None:
    """The last `Score: N` of the reply, if 0 <= N <= scale."""
    found = SCORE.findall(reply)
    if not found:
        return None
    score = float(found[-1])
    return score if 0.0 <= score <= scale else None


class JudgeEnvironment:
    """The wrapped environment's tasks and episodes, their rewards combined with a grader's."""

    def __init__(self, options: JudgeOptions) -> None:
        self.options = options
        self.inner = build(
            "env", options.env, options=options.env_options, options_path="env.options.env_options"
        )
        self.name = f"judge({getattr(self.inner, 'name', options.env)})"
        self._grader: tuple[InferenceEngine, Renderer] | None = None
        # built now, not on the first episode: a wrong directory stops the run before it starts
        self._reward_model = (
            None if options.reward_model is None else RewardModel(options.reward_model)
        )
        self._building = asyncio.Lock()

    async def splits(self) -> list[Split]:
        splits: list[Split] = await self.inner.splits()
        return splits

    async def num_tasks(self, split: str) -> int:
        count: int = await self.inner.num_tasks(split)
        return count

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        task: dict[str, Any] = await self.inner.get_task(split, index)
        return task

    async def open(self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> Any:
        return await self.inner.open(task, secrets)

    async def close(self) -> None:
        if self._grader is not None and self.options.grader is not None:
            await self._grader[0].close()
        if self._reward_model is not None:
            self._reward_model.close()
        await self.inner.close()

    async def _actor(
        self, engine: InferenceEngine, renderer: Renderer
    ) -> tuple[InferenceEngine, Renderer]:
        grader = self.options.grader
        if grader is None:
            return engine, renderer
        async with self._building:
            if self._grader is None:
                registry = get_registry()
                model = resolve_model(grader.model)
                engine_factory: Any = registry.get("inference_engine", grader.engine)
                renderer_factory: Any = registry.get("renderer", grader.renderer)
                self._grader = (
                    engine_factory.load()(
                        model, options=engine_factory.validate_options(None, "grader"), seed=0
                    ),
                    renderer_factory.load()(
                        model, options=renderer_factory.validate_options(None, "grader")
                    ),
                )
        return self._grader

    async def _task_prompt(self, task: Mapping[str, Any]) -> str:
        session = await self.inner.open(task)
        try:
            return blocks_text(await session.prompt())
        finally:
            await session.close()

    async def run_episode(
        self,
        task: Mapping[str, Any],
        engine: InferenceEngine,
        renderer: Renderer,
        config: EpisodeConfig,
    ) -> Trajectory:
        trajectory = await run_episode(self.inner, task, engine, renderer, config)
        if trajectory.error is not None or not trajectory.turns:
            return trajectory
        answer = renderer.parse_response(trajectory.turns[-1].completion.tokens)[0].content
        if self._reward_model is not None:
            prompt = [Message("user", await self._task_prompt(task))]
            judged = await self._reward_model.score_soon(prompt, answer)
        else:
            graded = await self._grade(task, answer, engine, renderer)
            if isinstance(graded, str):
                return attrs.evolve(trajectory, error=graded)
            judged = graded
        return attrs.evolve(
            trajectory,
            rewards=(*trajectory.rewards, judged),
            reward=self.options.env_weight * trajectory.reward + self.options.judge_weight * judged,
            metrics={
                **trajectory.metrics,
                "env/judge_score": judged,
                "env/reward/env": trajectory.reward,
            },
        )

    async def _grade(
        self, task: Mapping[str, Any], answer: str, engine: InferenceEngine, renderer: Renderer
    ) -> float | str:
        """The grader model's score of `answer` over the scale, or why its reply has none."""
        grader_engine, grader_renderer = await self._actor(engine, renderer)
        scale = self.options.scale
        prompt = grader_renderer.build_generation_prompt(
            [
                Message("system", self.options.rubric),
                Message(
                    "user",
                    f"Task:\n{await self._task_prompt(task)}\n\nAnswer:\n{answer}\n\n"
                    f"Reply with 'Score: N', N from 0 to {scale:g}.",
                ),
            ]
        )
        seed = zlib.crc32(repr(sorted(task.items())).encode())  # the same grade for the same task
        sampling = SamplingParams(temperature=0.0, max_tokens=self.options.max_tokens, seed=seed)
        reply = (await grader_engine.sample(prompt, 1, sampling)).sequences[0]
        text = grader_renderer.parse_response(reply.tokens)[0].content
        score = parse_score(text, scale)
        if score is None:
            return (
                f"{self.name}: the grader's reply has no 'Score: N' with 0 <= N <= "
                f"{scale:g}: {text[:200]!r}"
            )
        return score / scale


def make_judge(*, options: JudgeOptions) -> JudgeEnvironment:
    return JudgeEnvironment(options)
