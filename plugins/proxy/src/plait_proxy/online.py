"""Online RL: `plait serve online CONFIG` serves the policy of a run config through the proxy to
live clients and learns from the rewards they send back.

    client --chat--> proxy --sample--> serving engine        answer recorded (online_log), sent
    client --POST /v1/feedback {response_id, reward}-->      reward recorded, acknowledged
    learner: `batch_size` rewarded answers -> train -> candidate engine -> gate
             -> promote | roll back

Every answer is a trajectory: the turns of its conversation (a session named by the client, or
the one call) with the reward its client gave it, late or never (answers left without one past
`feedback_timeout_s` are dropped), or that the run's environment gave it when the request named
its task (`x-plait-task`). Advantages are each reward against the batch's mean (the
batch is one group: live prompts rarely repeat). Answers sampled more than
`off_policy.max_staleness` versions before the trainer's are left out.

The gate: each trained version is pushed to a candidate engine (a second inference engine of
the config's kind, never serving) and evaluated greedily on the first `eval.tasks` tasks of the
environment's `env.eval_split` (`gate_score`). It serves only if its score is within
`gate_tolerance` of the best version served since the server started; then its trainer state is
saved as the promoted one and the serving engines take it in flight (`off_policy.update_pause`).
A rejected version does not serve, and training goes on from it, unless it is a regression (more
than `regression_margin` below the best) or the trainer has got `off_policy.max_staleness`
versions ahead of the serving one: then the trainer rolls back to the promoted state (and reuses
the rejected versions' numbers: version numbers name what served). Each answer says which
version produced it: the `x-plait-weight-version` header and `plait.weight_version` in the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plait.api import (
    INFERENCE_ENGINE,
    WEIGHT_SYNC,
    ClosableWeightSync,
    Components,
    ConfigError,
    Environment,
    Policy,
    RunConfig,
    ToolError,
    Trajectory,
    build,
    build_components,
    close_components,
    engines_paused,
    evaluate_held_out,
    log_metrics,
    policy_metrics,
    prepare_groups,
    prepare_run_dir,
    publish_policy,
    structure,
    terminal_argument,
    train_prepared,
)
from plait_proxy.app import ProxyApp, ServeOptions, read_json
from plait_proxy.chat import Completion, RequestError
from plait_proxy.online_log import Answer, OnlineLog, Replayed, replay
from plait_proxy.proxy import Limits, Proxy
from plait_proxy.store import ProxySession, RolloutStore

log = structlog.get_logger("plait.online")
T = TypeVar("T")

PROMOTED = "promoted"
"""The trainer state of the serving version, under the online directory."""
TASK_HEADER = "x-plait-task"
"""A request's task (JSON) for the run's environment to judge its answer on, instead of feedback."""
MAX_BODY_BYTES = 64 * 1024
"""Of a feedback or settings request."""
ID_PREFIXES = ("chatcmpl-", "resp_", "msg_")
"""How the wire formats spell a response id around the proxy's own (feedback takes either)."""


@attrs.frozen(kw_only=True)
class OnlineOptions:
    """`[serve.online]` of the run config."""

    batch_size: int = attrs.field(default=32, validator=attrs.validators.ge(2))
    """Rewarded answers per update."""
    feedback_timeout_s: float = attrs.field(default=3600.0, validator=attrs.validators.gt(0))
    """How long an answer waits for its reward; later feedback is refused (404)."""
    gate_tolerance: float = attrs.field(default=0.05, validator=attrs.validators.ge(0))
    """How far below the best held-out score of any version served since start a candidate may
    score and still serve (against the best, not the serving one, so that small losses cannot add
    up)."""
    regression_margin: float = attrs.field(default=0.2, validator=attrs.validators.ge(0))
    """A candidate this far below the best is a regression: the trainer rolls back at once."""
    max_waiting: int = attrs.field(default=100_000, validator=attrs.validators.ge(1))
    """Answers held awaiting a reward; the oldest are dropped past it."""
    fsync: bool = False
    """fsync every record (survives a machine crash, not only a killed server)."""
    max_tokens: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    """Completion tokens of a request that sets no limit (one that sets more than its context
    allows is refused)."""
    served_model_names: tuple[str, ...] = ()
    """More names clients may call the served model by (`--served-model-name` replaces them)."""


class Feedback:
    """Answers awaiting a reward, and rewarded ones awaiting the learner."""

    def __init__(self, options: OnlineOptions, online_log: OnlineLog) -> None:
        self.options = options
        self.log = online_log
        self.waiting: dict[str, Answer] = {}
        self.ready: list[Answer] = []
        self.rewarded: set[str] = set()
        self.expired = self.answers = self.feedback = 0
        self.arrived = asyncio.Condition()

    def restore(self, directory: Path) -> Replayed:
        """Take back what a killed server left, its counts too; all it left."""
        earlier = replay(directory, since=time.time() - self.options.feedback_timeout_s)
        self.answers, self.feedback = earlier.answered, len(earlier.rewarded)
        self.rewarded = earlier.rewarded | earlier.trained
        for answer in earlier.answers:
            if answer.reward is not None:
                self.ready.append(answer)
            else:
                self.waiting[answer.id] = answer
        self._expire()
        log.info(
            "restored the online record",
            waiting=len(self.waiting),
            rewarded_untrained=len(self.ready),
            trained=len(earlier.trained),
            updates=earlier.updates,
        )
        return earlier

    def answered(self, answer: Answer) -> None:
        self.log.answered(answer)
        self.waiting[answer.id] = answer
        self.answers += 1
        self._expire()

    async def reward(self, answer_id: str, reward: float) -> int:
        """Record a reward; the number of rewarded answers awaiting the learner."""
        self._expire()
        answer = self.waiting.get(answer_id)
        if answer is None:
            if answer_id in self.rewarded:
                raise RequestError(
                    f"response {answer_id!r} already has its reward",
                    status=409,
                    param="response_id",
                )
            raise RequestError(
                f"no response {answer_id!r} awaits feedback: unknown, or answered over "
                f"{self.options.feedback_timeout_s:g} s ago (serve.online.feedback_timeout_s)",
                status=404,
                param="response_id",
                kind="not_found_error",
            )
        self.log.rewarded(answer_id, reward)
        del self.waiting[answer_id]
        self.rewarded.add(answer_id)
        self.ready.append(attrs.evolve(answer, reward=reward))
        self.feedback += 1
        async with self.arrived:
            self.arrived.notify_all()
        return len(self.ready)

    async def take(
        self, count: int, fresh: Callable[[Answer], bool]
    ) -> tuple[list[Answer], list[Answer]]:
        """The oldest `count` rewarded answers that are `fresh`, once there are that many, and the
        stale ones passed over meanwhile (they would only be dropped later)."""
        dropped: list[Answer] = []
        async with self.arrived:
            while True:
                kept: list[Answer] = []
                for answer in self.ready:
                    (kept if fresh(answer) else dropped).append(answer)
                self.ready = kept
                if len(self.ready) >= count:
                    break
                await self.arrived.wait()
        batch, self.ready = self.ready[:count], self.ready[count:]
        return batch, dropped

    def _expire(self) -> None:
        deadline = time.time() - self.options.feedback_timeout_s
        while self.waiting:
            oldest = next(iter(self.waiting.values()))
            if oldest.time >= deadline and len(self.waiting) <= self.options.max_waiting:
                break
            del self.waiting[oldest.id]
            self.expired += 1


class OnlineServer:
    """The learner, the gate and the HTTP routes beside the proxy's."""

    def __init__(
        self,
        config: RunConfig,
        components: Components,
        run_dir: Path,
        options: OnlineOptions,
        candidate: Policy,
    ) -> None:
        self.config = config
        self.components = components
        self.options = options
        self.policy = components.policies[0]
        self.candidate = candidate
        self.gate = attrs.evolve(components, policies=[candidate], sinks=[])
        """The candidate's components: the gate evaluates it as the run evaluates its policy."""
        self.directory = run_dir / "online"
        self.log = OnlineLog(self.directory, fsync=options.fsync)
        self.feedback = Feedback(options, self.log)
        self.learning_rate = self.policy.config.trainer.learning_rate
        self.updates = self.promotions = self.rejections = self.rollbacks = 0
        self.dropped_stale = self.failures = self.judge_errors = 0
        self.judging: set[asyncio.Task[None]] = set()
        self.judges = asyncio.Semaphore(16)
        """Answers the environment judges at once (each opens a session)."""
        self.learner: asyncio.Task[None] | None = None
        self.trainer_lock = threading.Lock()
        self.stopped: str | None = None
        self.backoff = 0
        """Rollbacks since the last promotion: each halves the learning rate (down to 1/64) until a
        version serves again. A rolled-back trainer holds the optimizer state it had, so an equal
        step would make the same candidate again."""
        self.serving_version = 0
        self.serving_score = self.best_score = math.nan
        """Held-out score (`gate_score`) of the serving version, and the best of any version
        served since start."""
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        """The last updates: version, gate verdict, and when the serving engines took it."""

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Restore what a killed server left (the promoted trainer state, answers and rewards),
        give the serving engines the promoted weights and measure them for the gate."""
        self._restore_counts(self.feedback.restore(self.directory))
        for answer in list(self.feedback.waiting.values()):
            if answer.task is not None:  # killed before the environment judged it
                self._judge_later(answer)
        promoted = self.directory / PROMOTED
        trainer = self.policy.trainer
        if promoted.exists():
            await self._in_thread(trainer.load_state, promoted)
        else:
            await self._in_thread(trainer.save_state, promoted)
        await publish_policy(self.components, self.policy)
        self.serving_version = trainer.weight_version
        self.serving_score = self.best_score = gate_score(
            await evaluate_held_out(self.config, self.components)
        )
        log.info("serving", version=self.serving_version, held_out_score=self.serving_score)

    def _restore_counts(self, earlier: Replayed) -> None:
        """The status goes on counting (and showing its last events) from where the killed
        server's record ends."""
        self.updates, self.dropped_stale = earlier.updates, earlier.dropped_stale
        for verdict in earlier.verdicts:
            if "error" in verdict:  # a failed update: logged, never an event
                self.failures += 1
                continue
            self.events.append(verdict)
            self.promotions += verdict["promoted"] is True
            self.rejections += verdict["promoted"] is False and "score" in verdict
            self.rollbacks += verdict.get("rolled_back") is True

    # -- answers and feedback ------------------------------------------------------------------

    def admit(self, headers: Mapping[str, str]) -> None:
        """`CompletionObserver`: a malformed `x-plait-task` is refused before anything is
        sampled."""
        _task(headers.get(TASK_HEADER))

    async def completed(
        self, session: ProxySession, completion: Completion, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """`CompletionObserver`: record the answer (its first choice) and the conversation that led
        to it before the client sees it; with an `x-plait-task` header, have the environment judge
        it."""
        task = _task(headers.get(TASK_HEADER))
        choice = completion.choices[0]
        versions = choice.sequence.versions()
        version = versions[-1] if versions else self.serving_version
        answer = Answer(
            completion.id,
            time.time(),
            version,
            tuple(session.conversation(completion.id)),
            task=task,
            text=choice.message.content if task is not None else "",
        )
        self.feedback.answered(answer)
        if task is not None:
            self._judge_later(answer)
        return {"response_id": completion.id, "weight_version": version}

    def _judge_later(self, answer: Answer) -> None:
        job = asyncio.create_task(self._judge(answer))
        self.judging.add(job)
        job.add_done_callback(self.judging.discard)

    async def _judge(self, answer: Answer) -> None:
        """The environment's reward for the answer, recorded as feedback (unless a client gave one
        first)."""
        assert answer.task is not None
        try:
            async with self.judges:
                reward = await asyncio.wait_for(
                    judge_answer(self.components.env, answer.task, answer.text),
                    self.config.rl.env_timeout_s,
                )
            await self.feedback.reward(answer.id, reward)
        except RequestError:
            pass  # rewarded through /v1/feedback meanwhile, or expired
        except Exception as exc:  # a bad task or a failing environment costs this answer its reward
            self.judge_errors += 1
            log.warning(
                "the environment could not judge an answer",
                response_id=answer.id,
                error=f"{type(exc).__name__}: {exc}",
            )

    async def post_feedback(self, request: Request) -> Response:
        body = await _json_object(request, '{"response_id": "...", "reward": 1.0}')
        answer_id = body.get("response_id")
        if not isinstance(answer_id, str) or not answer_id:
            raise RequestError(
                "response_id must be the id of a response (its `id`, or the "
                "x-plait-response-id header)",
                param="response_id",
            )
        answer_id, reward = _bare_id(answer_id), _number(body, "reward")
        queued = await self.feedback.reward(answer_id, reward)
        return JSONResponse({"response_id": answer_id, "accepted": True, "queued": queued})

    async def status(self, request: Request) -> Response:
        f = self.feedback
        return JSONResponse(
            {
                "serving_version": self.serving_version,
                "trainer_version": self.policy.trainer.weight_version,
                "serving_score": self.serving_score,
                "best_score": self.best_score,
                "learning_rate": self.learning_rate,
                "answers": f.answers,
                "feedback": f.feedback,
                "awaiting_feedback": len(f.waiting),
                "awaiting_training": len(f.ready),
                "expired": f.expired,
                "updates": self.updates,
                "promotions": self.promotions,
                "rejections": self.rejections,
                "rollbacks": self.rollbacks,
                "failed_updates": self.failures,
                "judge_errors": self.judge_errors,
                "judging": len(self.judging),
                "learning": "running" if self.stopped is None else f"stopped: {self.stopped}",
                "dropped_stale": self.dropped_stale,
                "events": list(self.events),
            }
        )

    async def settings(self, request: Request) -> Response:
        """Change the learning rate of the next updates (the gate still guards what serves)."""
        rate = _number(await _json_object(request, '{"learning_rate": 1e-4}'), "learning_rate")
        if rate <= 0:
            raise RequestError(f"learning_rate must be positive, got {rate}", param="learning_rate")
        self.learning_rate = rate
        log.info("learning rate changed", learning_rate=self.learning_rate)
        return JSONResponse({"learning_rate": self.learning_rate})

    def routes(self) -> list[Route]:
        return [
            Route("/v1/feedback", self.post_feedback, methods=["POST"]),
            Route("/v1/online/status", self.status, methods=["GET"]),
            Route("/v1/online/settings", self.settings, methods=["POST"]),
        ]

    # -- learning ------------------------------------------------------------------------------

    async def learn(self) -> None:
        """Update whenever `batch_size` rewarded answers wait; a failed update costs its batch.
        If even the rollback fails, learning stops (the status says why); serving goes on."""
        try:
            await self._learn()
        except Exception as exc:
            self.stopped = f"{type(exc).__name__}: {exc}"
            log.error(
                "online learning stopped; the server keeps serving the promoted version",
                error=self.stopped,
            )

    async def _learn(self) -> None:
        while True:
            batch, stale = await self.feedback.take(self.options.batch_size, self._fresh)
            self.dropped_stale += len(stale)
            if stale:
                self.log.updated({"update": self.updates, "stale": [a.id for a in stale]})
            self.updates += 1
            try:
                await self.update(batch)
            except Exception as exc:
                self.failures += 1
                log.error(
                    "online update failed; its batch is dropped and the trainer goes back to the "
                    "promoted state",
                    update=self.updates,
                    error=f"{type(exc).__name__}: {exc}",
                )
                self.log.updated(
                    {
                        "update": self.updates,
                        "version": self.serving_version,
                        "promoted": False,
                        "error": f"{type(exc).__name__}: {exc}",
                        "ids": [a.id for a in batch],
                    }
                )
                await self._in_thread(self.policy.trainer.load_state, self.directory / PROMOTED)
                if (
                    self.policy.engines[0].weight_version != self.serving_version
                ):  # the push failed midway
                    await self._serve_promoted()

    def _fresh(self, answer: Answer) -> bool:
        """Sampled within `off_policy.max_staleness` versions of the trainer's."""
        oldest = self.policy.trainer.weight_version - self.config.off_policy.max_staleness
        return all(v >= oldest for t in answer.turns for v in t.completion.versions())

    async def update(self, batch: list[Answer]) -> None:
        trainer, start = self.policy.trainer, time.perf_counter()
        rewards = [a.reward or 0.0 for a in batch]  # every answer taken was rewarded
        trajectories = [
            Trajectory(
                task={"response_id": a.id},
                turns=a.turns,
                rewards=(r,),
                reward=r,
                correct=r >= 1.0,
                finished=True,
            )
            for a, r in zip(batch, rewards, strict=True)
        ]
        trained_version, configured = trainer.weight_version, self.learning_rate
        learning_rate = configured * 0.5 ** min(self.backoff, 6)
        self.policy.config = attrs.evolve(
            self.policy.config,
            trainer=attrs.evolve(self.policy.config.trainer, learning_rate=learning_rate),
        )
        datums, prepared = await self._in_thread(
            prepare_groups, self.config, self.policy, [trajectories]
        )
        trained = await self._in_thread(
            functools.partial(train_prepared, always_step=False),
            self.config.rl,
            self.policy,
            datums,
        )
        train_seconds = time.perf_counter() - start
        metrics = policy_metrics(
            [trajectories],
            prepared=prepared,
            trained=trained,
            trainer=trainer,
            trained_version=trained_version,
            train_seconds=train_seconds,
        )
        event: dict[str, Any] = {
            "update": self.updates,
            "version": trainer.weight_version,
            "time": time.time(),
            "learning_rate": configured,
            "effective_learning_rate": learning_rate,
            "reward": metrics["reward/mean"],
        }
        # Consumed from here on: a server killed later comes back without these answers rather
        # than train them twice (the promoted state it restores may already hold them).
        self.log.updated(
            {
                "update": self.updates,
                "version": trainer.weight_version,
                "ids": [a.id for a in batch],
            }
        )
        if trainer.weight_version != trained_version:  # a step was taken: the gate decides
            metrics.update(await self._gate(event))
        else:
            event["promoted"] = False
        event["serving_version"] = self.serving_version
        metrics.update(
            {
                "online/serving_version": float(self.serving_version),
                "online/answers": float(self.feedback.answers),
                "online/feedback": float(self.feedback.feedback),
                "online/awaiting_feedback": float(len(self.feedback.waiting)),
                "online/dropped_stale": float(self.dropped_stale),
                "online/rejections": float(self.rejections),
                "online/rollbacks": float(self.rollbacks),
                "optim/lr": learning_rate,
                "time/train": train_seconds,
                "time/total": time.perf_counter() - start,
            }
        )
        self.events.append(event)
        self.log.updated(event)
        log_metrics(self.components.sinks, self.updates, metrics)

    async def _gate(self, event: dict[str, Any]) -> dict[str, float]:
        """Evaluate the trainer's new version on the candidate engine. It serves if it is within
        `gate_tolerance` of the best version served. If not, training goes on from it (a dip may
        pass) unless it is a regression (below the best by `regression_margin`) or the trainer is
        `off_policy.max_staleness` versions ahead of the serving one (its data would go stale):
        then the trainer rolls back to the promoted state."""
        trainer, start = self.policy.trainer, time.perf_counter()
        await publish_policy(self.gate, self.candidate)
        score = gate_score(await evaluate_held_out(self.config, self.gate))
        gate_seconds = time.perf_counter() - start
        promoted = score >= self.best_score - self.options.gate_tolerance
        regression = score < self.best_score - self.options.regression_margin
        rolled_back = not promoted and (
            regression
            or trainer.weight_version - self.serving_version >= self.config.off_policy.max_staleness
        )
        event.update(
            promoted=promoted,
            rolled_back=rolled_back,
            score=score,
            serving_score=self.serving_score,
            best_score=self.best_score,
        )
        metrics = {
            "gate/score": score,
            "gate/serving_score": self.serving_score,
            "gate/best_score": self.best_score,
            "gate/promoted": float(promoted),
            "gate/rolled_back": float(rolled_back),
            "time/gate": gate_seconds,
        }
        if promoted:  # saved first: from here on it is the version that serves, after a restart too
            await self._in_thread(trainer.save_state, self.directory / PROMOTED)
            self.promotions += 1
            self.serving_version, self.serving_score = trainer.weight_version, score
            self.best_score = max(self.best_score, score)
            self.backoff = 0
            event["push_start"] = time.time()
            metrics.update(await self._serve_promoted())
            event["push_end"] = time.time()
            return metrics
        self.rejections += 1
        if rolled_back:
            self.rollbacks += 1
            log.warning(
                "rolling the trainer back to the serving version",
                candidate=trainer.weight_version,
                score=score,
                best_score=self.best_score,
                regression=regression,
            )
            self.backoff += 1
            await self._in_thread(trainer.load_state, self.directory / PROMOTED)
        return metrics

    async def _serve_promoted(self) -> dict[str, float]:
        """Push the trainer's weights (the promoted version) to the serving engines in flight:
        requests keep going, and the engines resume whatever happens."""
        start = time.perf_counter()
        async with engines_paused(self.policy.engines, self.config.off_policy):
            metrics = await publish_policy(self.components, self.policy)
        return {**metrics, "time/sync": time.perf_counter() - start}

    async def _in_thread(self, work: Callable[..., T], *args: Any) -> T:
        """Trainer work off the event loop, one at a time; `close` waits for the one running."""

        def locked() -> T:
            with self.trainer_lock:
                return work(*args)

        return await asyncio.to_thread(locked)

    async def close(self) -> None:
        """Stop learning and judging; wait for trainer work already running in its thread."""
        jobs = [j for j in [self.learner, *self.judging] if j is not None]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await asyncio.to_thread(self.trainer_lock.acquire)
        self.trainer_lock.release()
        self.log.close()
        if isinstance(self.candidate.sync, ClosableWeightSync):
            await self.candidate.sync.close()
        for engine in self.candidate.engines:
            await engine.close()


async def judge_answer(env: Environment, task: Mapping[str, Any], text: str) -> float:
    """The reward `env` gives `text` as the final answer to `task`: its terminal tool
    (`final_answer` of the math environments) called with the text, in a session of its own."""
    session = await env.open(task)
    try:
        tool = await session.terminal_tool()
        if tool is None:
            raise ConfigError(
                "env.name",
                "the environment has no terminal tool to judge answers with",
                fix="give rewards through POST /v1/feedback instead of x-plait-task",
            )
        outcome = await session.call(tool.name, {terminal_argument(tool): text})
    finally:
        await session.close()
    if isinstance(outcome, ToolError):
        raise RuntimeError(f"the environment's {tool.name} failed: {outcome.error}")
    return float(outcome.reward or 0.0)


def _task(header: str | None) -> dict[str, Any] | None:
    if header is None:
        return None
    try:
        task = json.loads(header)
    except ValueError as exc:
        raise RequestError(
            f"the {TASK_HEADER} header is not valid JSON: {exc}", param=TASK_HEADER
        ) from None
    if not isinstance(task, dict):
        raise RequestError(
            f"the {TASK_HEADER} header must be a JSON object (a task of env.name)",
            param=TASK_HEADER,
        )
    return task


def gate_score(evaluation: Mapping[str, float]) -> float:
    """What the gate compares: the mean reward of the sampled answers (`eval.samples_per_task` > 1,
    at `eval.temperature`: what clients that sample get), else greedy accuracy."""
    return evaluation.get("eval/mean", evaluation["eval/accuracy"])


def _bare_id(answer_id: str) -> str:
    for prefix in ID_PREFIXES:
        if answer_id.startswith(prefix):
            return answer_id[len(prefix) :]
    return answer_id


async def _json_object(request: Request, example: str) -> dict[str, Any]:
    body = await read_json(request, MAX_BODY_BYTES, 8)
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object: {example}")
    return body


def _number(body: dict[str, Any], key: str) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{key} must be a finite number, got {value!r}", param=key)
    return float(value)


def online_options(config: RunConfig) -> OnlineOptions:
    return structure(OnlineOptions, config.serve.get("online", {}), "serve.online")


@contextlib.asynccontextmanager
async def online_server(
    config: RunConfig, serve: ServeOptions, *, fresh: bool = False
) -> AsyncIterator[tuple[str, OnlineServer]]:
    """Build the run's components and a candidate engine, restore, and serve with the learner
    running until the block ends; yields the base URL and the server."""
    options = online_options(config)
    if config.policies:
        raise ConfigError(
            "policies",
            "plait serve online serves one policy",
            fix="remove [policies] from the config",
        )
    if config.rl.kl.on_engine:
        raise ConfigError(
            "rl.kl.reference",
            "online RL's episodes come through the proxy, and the frozen reference engine "
            "scores only the run loop's",
            fix="use rl.kl.reference = 'trainer' (plait-torch: trainer.options.reference = true)",
        )
    run_dir = prepare_run_dir(config, resume=not fresh)
    components = build_components(config, run_dir)
    server: OnlineServer | None = None
    try:
        policy = components.policies[0]
        candidate_engine = build(
            INFERENCE_ENGINE,
            config.inference.engine,
            policy.model,
            options=config.inference.options,
            options_path="inference.options",
            seed=config.run.seed,
        )
        sync_options = dict(config.sync.options)
        if sync_options.get("directory"):  # the serving sync's receivers live there too
            sync_options["directory"] = str(Path(sync_options["directory"]) / "candidate")
        candidate = attrs.evolve(
            policy,
            engines=[candidate_engine],
            sync=build(
                WEIGHT_SYNC,
                config.sync.method,
                options=sync_options,
                options_path="sync.options",
            ),
        )
        server = OnlineServer(config, components, run_dir, options, candidate)
        await server.start()
        proxy = Proxy(
            policy.engines[0],
            policy.renderer,
            config.model.name,
            Limits(max_tokens=options.max_tokens),
        )
        app = ProxyApp(
            proxy,
            RolloutStore(),
            attrs.evolve(serve, session_per_request=True),
            observer=server,
            routes=server.routes(),
        )
        server.learner = asyncio.create_task(server.learn())
        async with app.serving() as url:
            yield url, server
    finally:
        if server is not None:
            await server.close()
        await close_components(components)
