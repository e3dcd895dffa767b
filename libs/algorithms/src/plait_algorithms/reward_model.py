"""Bradley–Terry reward models: trained on preference pairs by plait's supervised path, then a
grader for the `judge` environment (`env.options.reward_model`).

A reward model is a value model (plait-torch: trainer.options.value_head = true). Its score of
a reply is its value after the reply's last token: the conversation and the reply rendered as a
supervised example (the renderer's tokens, end of turn included), read at the last position.
Training makes P(chosen is preferred) = sigmoid(r_chosen - r_rejected) likely: each step
minimises the mean over its pairs of -log sigmoid(r_chosen - r_rejected).

A step is three calls any trainer engine takes, in any micro-batch layout, as Tinker's
forward_backward_custom does: `forward` for the scores, the pairwise loss's gradient with respect
to each score computed here, then `forward_backward` with `cross_entropy`, whose loss -sum(w *
output) is linear in the model's output, so that weights w = -d(loss)/d(score) give it exactly
the pairwise loss's gradient; then `optim_step`. The price is one extra forward pass a step.

Pairs are JSON lines: {"prompt": "..." or [{"role": ..., "content": ...}, ...], "chosen": "...",
"rejected": "..."}. `train_reward_model` writes a directory: `reward_model.json` (what to build
again: model, engine, renderer, trainer options; and the run's held-out accuracy), `state/` (the
trainer's saved state) and `metrics.jsonl` (one row a step). `RewardModel(directory)` loads it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from plait.api import (
    RENDERER,
    TRAINER_ENGINE,
    AdamParams,
    DataError,
    Datum,
    Message,
    ModelInput,
    Renderer,
    TrainerEngine,
    get_registry,
    resolve_model,
)
from plait_algorithms.datums import forward_outputs

MANIFEST = "reward_model.json"
STATE = "state"
METRICS = "metrics.jsonl"


@attrs.frozen
class PreferencePair:
    """A conversation and two replies to it, the first preferred."""

    prompt: tuple[Message, ...]
    chosen: str
    rejected: str


def read_pairs(path: Path) -> list[PreferencePair]:
    """The preference pairs of a JSON-lines file; a bad line is a DataError naming it."""
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not JSON ({exc.msg})", fix=_PAIR_FIX) from None
        pairs.append(parse_pair(row, where))
    if not pairs:
        raise DataError(f"{path} holds no preference pairs", fix=_PAIR_FIX)
    return pairs


_PAIR_FIX = (
    'write one pair a line: {"prompt": "..." or [{"role": "user", "content": "..."}], '
    '"chosen": "...", "rejected": "..."}'
)


def parse_pair(row: Any, where: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: a pair is a JSON object, got {type(row).__name__}", fix=_PAIR_FIX
        )
    for key in ("prompt", "chosen", "rejected"):
        if key not in row:
            raise DataError(f"{where}: no {key!r}", fix=_PAIR_FIX)
    for key in ("chosen", "rejected"):
        if not isinstance(row[key], str):
            raise DataError(f"{where}: {key!r} must be a string", fix=_PAIR_FIX)
    prompt = row["prompt"]
    if isinstance(prompt, str):
        messages: tuple[Message, ...] = (Message("user", prompt),)
    elif isinstance(prompt, list) and prompt:
        try:
            messages = tuple(Message(m["role"], m["content"]) for m in prompt)
        except (KeyError, TypeError):
            raise DataError(
                f"{where}: 'prompt' messages need 'role' and 'content'", fix=_PAIR_FIX
            ) from None
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages", fix=_PAIR_FIX)
    return PreferencePair(messages, row["chosen"], row["rejected"])


def bradley_terry(chosen: np.ndarray, rejected: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean over pairs of -log sigmoid(r_c - r_r), and its gradient with respect to each
    pair's margin r_c - r_r: -sigmoid(-(r_c - r_r)) / pairs."""
    margin = np.asarray(chosen, np.float64) - np.asarray(rejected, np.float64)
    loss = float(np.logaddexp(0.0, -margin).mean())
    return loss, -0.5 * (1.0 - np.tanh(margin / 2)) / margin.size


def reply_datum(renderer: Renderer, prompt: Sequence[Message], reply: str) -> Datum:
    """The conversation with `reply` as its last message, its score read at the last token (the
    `mask`; `weights` 0 until a step gives them)."""
    tokens = renderer.build_supervised_example([*prompt, Message("assistant", reply)])[0].to_ints()
    last = np.zeros(len(tokens), np.float32)
    last[-1] = 1.0
    return Datum(
        ModelInput.from_ints(tokens),
        {"target_tokens": [*tokens[1:], tokens[-1]], "weights": np.zeros_like(last), "mask": last},
    )


def _weighed(datum: Datum, weight: float) -> Datum:
    mask = datum.loss_fn_inputs["mask"].to_numpy()
    return Datum(datum.model_input, {**datum.loss_fn_inputs, "weights": mask * weight})


def scores(trainer: TrainerEngine, data: Sequence[Datum], micro_batch_size: int) -> np.ndarray:
    """The value model's score of each datum: its value at the datum's last position."""
    values = forward_outputs(
        trainer,
        data,
        "values",
        "cross_entropy",
        {},
        micro_batch_size,
        missing=(
            "a reward model (a value model)",
            "build it with a value head (plait-torch: options value_head = true)",
        ),
    )
    return np.asarray([float(v[-1]) for v in values])


def _scored_pairs(
    trainer: TrainerEngine,
    renderer: Renderer,
    pairs: Sequence[PreferencePair],
    micro_batch_size: int,
) -> tuple[list[Datum], np.ndarray, np.ndarray]:
    """Each pair's chosen and rejected reply as datums, side by side (a pair's shared prompt
    stays together for prefix sharing), and the scores of the chosen and of the rejected."""
    data = [reply_datum(renderer, p.prompt, r) for p in pairs for r in (p.chosen, p.rejected)]
    both = scores(trainer, data, micro_batch_size)
    return data, both[0::2], both[1::2]


def pair_step(
    trainer: TrainerEngine,
    renderer: Renderer,
    pairs: Sequence[PreferencePair],
    adam: AdamParams,
    micro_batch_size: int,
) -> dict[str, float]:
    """One optimizer step of the Bradley–Terry loss on `pairs`; its metrics."""
    data, chosen, rejected = _scored_pairs(trainer, renderer, pairs, micro_batch_size)
    loss, grad = bradley_terry(chosen, rejected)
    # cross_entropy's gradient with respect to an output is -w; d(loss)/d(r_chosen) is grad and
    # d(loss)/d(r_rejected) is -grad
    weights = np.stack([-grad, grad], axis=1).ravel()
    weighted = [_weighed(datum, w) for datum, w in zip(data, weights, strict=True)]
    for start in range(0, len(weighted), micro_batch_size):
        trainer.forward_backward(weighted[start : start + micro_batch_size], "cross_entropy")
    step = trainer.optim_step(adam)
    return {
        "loss": loss,
        "accuracy": ranked(chosen, rejected),
        "margin": float((chosen - rejected).mean()),
        **{f"optim/{k}": v for k, v in step.metrics.items()},
    }


def pair_accuracy(
    trainer: TrainerEngine,
    renderer: Renderer,
    pairs: Sequence[PreferencePair],
    micro_batch_size: int,
) -> dict[str, float]:
    """The share of `pairs` whose chosen reply scores higher (`ranked`), and their mean loss."""
    _, chosen, rejected = _scored_pairs(trainer, renderer, pairs, micro_batch_size)
    loss, _ = bradley_terry(chosen, rejected)
    return {"accuracy": ranked(chosen, rejected), "loss": loss}


def ranked(chosen: np.ndarray, rejected: np.ndarray) -> float:
    """The share of pairs the scores rank right, a tie counting half (as a coin flip would)."""
    return float(np.mean((chosen > rejected) + 0.5 * (chosen == rejected)))


@attrs.frozen(kw_only=True)
class RewardModelSettings:
    """What `plait reward-model train` builds and how it trains it."""

    model: str
    engine: str = "torch"
    renderer: str = "chat_template"
    options: dict[str, Any] = attrs.field(factory=dict)
    """The trainer engine's options; value_head = true is added where the engine has it."""
    steps: int = attrs.field(default=100, validator=attrs.validators.gt(0))
    pairs_per_step: int = attrs.field(default=16, validator=attrs.validators.gt(0))
    learning_rate: float = attrs.field(default=1e-4, validator=attrs.validators.gt(0))
    micro_batch_size: int = attrs.field(default=16, validator=attrs.validators.gt(0))
    eval_every: int = attrs.field(default=25, validator=attrs.validators.gt(0))
    seed: int = 0


def build_reward_model(settings: RewardModelSettings) -> tuple[TrainerEngine, Renderer]:
    """A value-model trainer and the renderer of `settings.model` (errors name the option)."""
    registry = get_registry()
    model = resolve_model(settings.model)
    engine = registry.get(TRAINER_ENGINE, settings.engine)
    options = dict(settings.options)
    options_class = engine.options_class()
    if options_class is not None and "value_head" in attrs.fields_dict(options_class):
        options.setdefault("value_head", True)
    built_options = engine.validate_options(options, "reward_model.options (-o)")
    renderer_factory = registry.get(RENDERER, settings.renderer)
    renderer = renderer_factory.load()(
        model, options=renderer_factory.validate_options(None, "reward_model.renderer")
    )
    trainer = engine.load()(model, options=built_options, seed=settings.seed)
    if not trainer.capabilities.value_head:
        trainer.close()
        raise DataError(
            f"trainer engine {settings.engine!r} built no value head, so it cannot score replies",
            fix="turn its value head on with -o (plait-torch's torch has it on by default; a "
            "service's trainer: -o engine_options='{value_head = true}')",
        )
    return trainer, renderer


def train_reward_model(
    settings: RewardModelSettings,
    pairs: Sequence[PreferencePair],
    held_out: Sequence[PreferencePair],
    out: Path,
    on_step: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
    """`settings.steps` Bradley–Terry steps on batches drawn from `pairs` (shuffled, epoch by
    epoch), the held-out pairs' accuracy before, every `eval_every` steps and after; the model
    saved under `out` (see the module's docstring). Returns what `reward_model.json` records."""
    if not pairs or not held_out:
        raise DataError(
            f"a reward model needs pairs to train on and pairs held out; got {len(pairs)} and "
            f"{len(held_out)}",
            fix="give both (the command keeps a tenth of its pairs out unless --held-out)",
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the directory is no model until this one is saved
    trainer, renderer = build_reward_model(settings)
    adam = AdamParams(learning_rate=settings.learning_rate)
    rng = random.Random(settings.seed)
    order: list[int] = []
    try:
        held_out_before = pair_accuracy(trainer, renderer, held_out, settings.micro_batch_size)
        with (out / METRICS).open("w") as log:
            for step in range(1, settings.steps + 1):
                batch: list[PreferencePair] = []
                while len(batch) < settings.pairs_per_step:
                    if not order:
                        order = rng.sample(range(len(pairs)), len(pairs))
                    batch.append(pairs[order.pop()])
                row: dict[str, Any] = {
                    "step": step,
                    **pair_step(trainer, renderer, batch, adam, settings.micro_batch_size),
                }
                if step % settings.eval_every == 0 or step == settings.steps:
                    held = pair_accuracy(trainer, renderer, held_out, settings.micro_batch_size)
                    row |= {f"held_out/{k}": v for k, v in held.items()}
                log.write(json.dumps(row) + "\n")
                on_step(row)
        trainer.save_state(out / STATE)
    finally:
        trainer.close()
    manifest = {
        "model": settings.model,
        "engine": settings.engine,
        "renderer": settings.renderer,
        "options": settings.options,
        "seed": settings.seed,
        "pairs": len(pairs),
        "steps": settings.steps,
        "held_out_pairs": len(held_out),
        "held_out_accuracy_before": held_out_before["accuracy"],
        "held_out_accuracy": row["held_out/accuracy"],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


class RewardModel:
    """A reward model `train_reward_model` wrote, loaded to score replies: one reply a forward
    pass, on a thread of its own (`score_soon`), so that scoring never waits on, or holds up,
    the threads a run's other work uses."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise DataError(
                f"{directory} is not a reward model: it has no {MANIFEST}",
                fix="give the directory `plait reward-model train --out DIR` wrote",
            )
        manifest = json.loads(manifest_path.read_text())
        self.trainer, self.renderer = build_reward_model(
            RewardModelSettings(
                model=manifest["model"],
                engine=manifest["engine"],
                renderer=manifest["renderer"],
                options=manifest["options"],
                seed=manifest["seed"],
            )
        )
        try:
            # the weights alone where the engine can (plait-torch): scoring needs no AdamW state
            if "optimizer" in inspect.signature(self.trainer.load_state).parameters:
                self.trainer.load_state(directory / STATE, optimizer=False)  # type: ignore[call-arg]
            else:
                self.trainer.load_state(directory / STATE)
        except BaseException:
            self.trainer.close()
            raise
        self._lock = threading.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "reward-model")

    def score(self, prompt: Sequence[Message], reply: str) -> float:
        with self._lock:
            return float(scores(self.trainer, [reply_datum(self.renderer, prompt, reply)], 1)[0])

    async def score_soon(self, prompt: Sequence[Message], reply: str) -> float:
        """`score` on the model's own thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, self.score, prompt, reply
        )

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        with self._lock:
            self.trainer.close()
