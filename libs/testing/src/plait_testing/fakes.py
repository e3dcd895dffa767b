"""In-memory components for run-loop tests that take seconds: a model of one logit per token.

The fake policy ignores its context: it samples each token from softmax(logits) over a vocabulary
of 16 (0 = BOS, 1 = EOS, 2..15 the letters a..n). The fake trainer trains those logits with the
importance-sampling policy gradient (plain SGD at the configured learning rate), so a run on the
fake environment (reward 1 when an answer starts with "c") really learns, and weight versions,
syncs, checkpoints and resume behave as they do with real engines. Each component can be told to
fail the way a real one does (`fail_*` options), which is what the tests of the run's failure
handling need.

Load them into a run with `PLAIT_PLUGIN_MODULES=plait_testing.fakes` and the names "fake"
(trainer.engine, inference.engine, renderer.name, sync.method), "fake.critic" (a `[critic]`'s
trainer.engine) and "fake.letters" (env.name);
`model.name` is any directory holding a `config.json` (`fake_model_dir`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from plait.api import (
    AdamParams,
    Datum,
    EngineError,
    EngineHealth,
    ForwardBackwardOutput,
    Message,
    ModelInput,
    OptimStepResult,
    ParseTermination,
    RegisterEnv,
    RegisterInferenceEngine,
    RegisterRenderer,
    RegisterTrainerEngine,
    RegisterWeightSync,
    ResolvedModel,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Split,
    SyncStats,
    TensorData,
    TextBlock,
    Tokenizer,
    ToolOutput,
    ToolSpec,
    TrainerCapabilities,
    TrainerEngine,
    TrainOnWhat,
    WeightUpdate,
    hookimpl,
    positive,
    prompt_token_ids,
)

VOCAB = 16
BOS, EOS = 0, 1
FIRST_LETTER = 2


def fake_model_dir(path: Path) -> Path:
    """A directory that `model.name` accepts for the fake components."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "plait-fake", "vocab": VOCAB}))
    return path


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


class FakeTokenizer:
    """Letters a..n as ids 2..15; other characters fold onto them."""

    eos_token_id: int | None = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [FIRST_LETTER + (ord(c) - ord("a")) % (VOCAB - FIRST_LETTER) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i - FIRST_LETTER) for i in ids if i >= FIRST_LETTER)

    def __len__(self) -> int:
        return VOCAB


@attrs.frozen
class FakeRendererOptions:
    fail_parse: bool = False
    """Raise KeyError from parse_response, as a renderer with a bug does."""


class FakeRenderer:
    """BOS, then every message's text; a response is its letters."""

    has_extension_property = True

    def __init__(self, model: ResolvedModel, *, options: FakeRendererOptions) -> None:
        self.tokenizer: Tokenizer = FakeTokenizer()
        self.options = options

    def _ids(self, messages: Sequence[Message]) -> list[int]:
        return [i for m in messages for i in self.tokenizer.encode(m.content)]

    def build_generation_prompt(
        self,
        messages: Sequence[Message],
        role: str = "assistant",
        prefill: str | None = None,
        tools: Sequence[ToolSpec] | None = None,
    ) -> ModelInput:
        return ModelInput.from_ints([BOS, *self._ids(messages)])

    def build_supervised_example(
        self,
        messages: Sequence[Message],
        train_on: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
        tools: Sequence[ToolSpec] | None = None,
    ) -> tuple[ModelInput, list[float]]:
        ids = [BOS, *self._ids(messages)]
        return ModelInput.from_ints(ids), [0.0] + [1.0] * (len(ids) - 1)

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        if self.options.fail_parse:
            raise KeyError(f"token {tokens[0] if tokens else None} has no entry")
        ended = bool(tokens) and tokens[-1] == EOS
        termination = ParseTermination.EOS if ended else ParseTermination.TRUNCATED
        return Message("assistant", self.tokenizer.decode(tokens)), termination

    def stop_sequences(self) -> list[int]:
        return [EOS]

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        return [*prev_prompt_ids, *prev_completion_ids, *self._ids(new_messages)]


@attrs.frozen
class FakeEngineOptions:
    crash_after: int | None = None
    """Every request after this many raises EngineError, as an engine whose server died does."""
    flaky_every: int = 0
    """Every flaky_every-th request fails once (a transient error a retry gets past); 0 = never."""


class FakeInferenceEngine:
    """Samples the letters from softmax(logits), whatever the prompt."""

    def __init__(self, model: ResolvedModel, *, options: FakeEngineOptions, seed: int) -> None:
        self.options = options
        self.logits = np.zeros(VOCAB)
        self.requests = 0
        self.closed = False
        self.failed: set[tuple[tuple[int, ...], int | None]] = set()
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        prompt_token_ids(prompt, VOCAB)
        await asyncio.sleep(0)  # a real engine awaits its server: other episodes go on meanwhile
        if self.closed:
            raise EngineError("the inference engine was closed")
        self.requests += 1
        crash_after, flaky = self.options.crash_after, self.options.flaky_every
        if crash_after is not None and self.requests > crash_after:
            raise EngineError("inference server crashed (exit code -9)")
        request = (tuple(prompt.to_ints()), sampling_params.seed)
        if flaky and self.requests % flaky == 0 and request not in self.failed:
            self.failed.add(request)  # its retry goes through
            raise EngineError("connection reset by peer")
        rng = np.random.default_rng(sampling_params.seed)
        return SampleResponse([self._sequence(rng, sampling_params) for _ in range(num_samples)])

    def _sequence(self, rng: np.random.Generator, params: SamplingParams) -> SampledSequence:
        logprobs = _log_softmax(self.logits)
        tokens: list[int] = []
        while params.max_tokens is None or len(tokens) < params.max_tokens:
            if params.temperature == 0:
                token = int(np.argmax(logprobs))
            else:
                token = int(
                    rng.choice(VOCAB, p=np.exp(_log_softmax(self.logits / params.temperature)))
                )
            tokens.append(token)
            if token == EOS:
                break
        stop: Literal["stop", "length"] = "stop" if tokens[-1] == EOS else "length"
        return SampledSequence(
            tokens, [float(logprobs[t]) for t in tokens], stop, weight_version=self._version
        )

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        logprobs = _log_softmax(self.logits)
        return [None, *(float(logprobs[t]) for t in prompt.to_ints()[1:])]

    async def pause(self, mode: str = "keep") -> None:
        """Nothing runs between awaits."""

    async def resume(self) -> None:
        """Nothing was paused."""

    async def apply_weights(self, update: WeightUpdate) -> None:
        self.logits = np.array(update.tensors["logits"], dtype=np.float64)
        self._version = update.version

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, weight_version=self._version)

    async def close(self) -> None:
        self.closed = True


class _SgdArray:
    """A trainer of one array (`weights`, exported under `name`) by plain SGD, its state saved as
    JSON in `state_file`: what the fake policy and the fake critic share."""

    name: str
    state_file: str

    def __init__(self, model: ResolvedModel, *, options: Any, seed: int) -> None:
        self.weights = np.zeros(VOCAB)
        self.grad = np.zeros(VOCAB)
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        grad_norm = float(np.linalg.norm(self.grad))
        self.weights = self.weights - adam_params.learning_rate * self.grad
        self.grad = np.zeros(VOCAB)
        self._version += 1
        return OptimStepResult(self._version, {"grad_norm": grad_norm})

    def save_state(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f"{self.state_file}.tmp"
        tmp.write_text(json.dumps({self.name: self.weights.tolist(), "version": self._version}))
        os.replace(tmp, path / self.state_file)

    def load_state(self, path: str | Path) -> None:
        state = json.loads((Path(path) / self.state_file).read_text())
        self.weights, self._version = np.asarray(state[self.name]), int(state["version"])

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        yield self.name, self.weights.copy()

    def close(self) -> None:
        """Holds nothing."""


class FakeTrainer(_SgdArray):
    """The logits, trained by SGD on -sum(advantage * logprob) over the loss mask."""

    capabilities = TrainerCapabilities()
    name, state_file = "logits", "fake.json"

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        logprobs = _log_softmax(self.weights)
        outputs = [
            {
                "logprobs": TensorData.from_numpy(
                    logprobs[d.loss_fn_inputs["target_tokens"].to_numpy()]
                )
            }
            for d in data
        ]
        return ForwardBackwardOutput("fake", outputs, {})

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        probs = np.exp(_log_softmax(self.weights))
        loss = 0.0
        for datum in data:
            inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
            weights = inputs["advantages"] if "advantages" in inputs else inputs["weights"]
            if "mask" in inputs:
                weights = weights * inputs["mask"]
            for token, weight in zip(inputs["target_tokens"], weights, strict=True):
                # d(-w log p_t)/d logits = -w (onehot(t) - p)
                self.grad -= weight * (np.eye(VOCAB)[int(token)] - probs)
                loss -= weight * float(np.log(probs[int(token)]))
        out = self.forward(data)
        return ForwardBackwardOutput("fake", out.loss_fn_outputs, {"loss:sum": float(loss)})


class FakeValueModel(_SgdArray):
    """A critic of one value per token: the value at a position is that of its input token,
    trained by SGD on the value loss's squared error (unclipped), weighed as the data say, or
    on cross_entropy's -sum(w * value) (what a value model's output makes of that loss)."""

    capabilities = TrainerCapabilities(value_head=True)
    name, state_file = "table", "fake_critic.json"

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "value",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        outputs = [
            {"values": TensorData.from_numpy(self.weights[d.model_input.to_ints()])} for d in data
        ]
        return ForwardBackwardOutput("value", outputs, {})

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        loss = 0.0
        for datum in data:
            inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
            tokens = datum.model_input.to_ints()
            if loss_fn == "cross_entropy":
                np.add.at(self.grad, tokens, -inputs["weights"])
                loss -= float((inputs["weights"] * self.weights[tokens]).sum())
                continue
            error = self.weights[tokens] - inputs["returns"]
            np.add.at(self.grad, tokens, inputs["weights"] * error)
            loss += float(0.5 * (inputs["weights"] * error**2).sum())
        out = self.forward(data)
        return ForwardBackwardOutput("value", out.loss_fn_outputs, {"loss:sum": loss})


class FakeSync:
    """Hands the trainer's arrays to each engine."""

    def __init__(self, *, options: Any) -> None:
        """Takes no options."""

    async def push(self, trainer: TrainerEngine, engines: Sequence[Any], version: int) -> SyncStats:
        tensors = dict(trainer.export_weights())
        for engine in engines:
            await engine.apply_weights(WeightUpdate(version, tensors))
        return SyncStats(version, sum(t.nbytes for t in tensors.values()), 0.0)


@attrs.frozen
class FakeEnvOptions:
    tasks: int = 8
    fail_fraction: float = 0.0
    """The tasks whose index is below this fraction of `tasks` raise when graded, as an
    environment whose server died does."""
    signal_every: int = attrs.field(default=1, validator=positive)
    """Only the tasks whose index is a multiple of this reward a right answer; the others reward
    every answer 0, so that each of their groups has equal rewards (dynamic sampling's case)."""


class _LettersSession:
    def __init__(self, task: Mapping[str, Any], fails: bool, rewarded: bool = True) -> None:
        self.task, self.fails, self.rewarded = task, fails, rewarded

    async def prompt(self) -> list[Any]:
        return [TextBlock(f"task {self.task['index']}: answer with c")]

    async def messages(self) -> list[Message]:
        return [Message("user", "abc")]

    async def tools(self) -> list[ToolSpec]:
        return []

    async def terminal_tool(self) -> ToolSpec:
        return ToolSpec("answer", "the answer", {"properties": {"answer": {"type": "string"}}})

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput:
        if self.fails:
            raise ConnectionError("environment server closed the connection")
        correct = self.rewarded and str(input.get("answer", "")).startswith("c")
        return ToolOutput(reward=float(correct), finished=True)

    async def close(self) -> None:
        """Holds nothing."""


class LettersEnv:
    """Every task asks for an answer that starts with "c" (`FakeEnvOptions.signal_every`: only
    some reward it)."""

    name = "fake.letters"

    def __init__(self, *, options: FakeEnvOptions) -> None:
        self.options = options

    async def splits(self) -> list[Split]:
        return [Split("train"), Split("test", "test")]

    async def num_tasks(self, split: str) -> int:
        return self.options.tasks

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        return {"index": index, "split": split}

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> _LettersSession:
        fails = task["index"] < self.options.fail_fraction * self.options.tasks
        return _LettersSession(task, fails, task["index"] % self.options.signal_every == 0)

    async def close(self) -> None:
        """Holds nothing."""


@hookimpl
def plait_register_trainer_engines(register: RegisterTrainerEngine) -> None:
    register("fake", FakeTrainer, description="in-memory logits (plait_testing.fakes)")
    register("fake.critic", FakeValueModel, description="in-memory values, a critic's")


@hookimpl
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    register("fake", FakeInferenceEngine, options=FakeEngineOptions)


@hookimpl
def plait_register_renderers(register: RegisterRenderer) -> None:
    register("fake", FakeRenderer, options=FakeRendererOptions)


@hookimpl
def plait_register_weight_syncs(register: RegisterWeightSync) -> None:
    register("fake", FakeSync)


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register("fake.letters", LettersEnv, options=FakeEnvOptions)
