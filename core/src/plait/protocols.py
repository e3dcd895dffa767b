"""The contracts of plait's five moving parts, as typing.Protocols.

A plugin implements one of these and registers a factory for it (see `plait.hookspecs`). The
contract test kits in `plait_testing` check an implementation against its protocol; every plugin
runs the kit against itself.

Trainer engines are synchronous (compute-bound; the controller runs them in a worker thread when it
needs concurrency). Inference engines, weight syncs and environments are asynchronous, because they
wait on I/O: servers, containers, other processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from plait.types import (
    AdamParams,
    Block,
    Datum,
    EngineHealth,
    ForwardBackwardOutput,
    LoraConfig,
    Message,
    ModelInput,
    OptimStepResult,
    ParseTermination,
    PauseMode,
    SampleResponse,
    SamplingParams,
    Split,
    SyncStats,
    ToolError,
    ToolOutput,
    ToolSpec,
    TrainerCapabilities,
    TrainOnWhat,
    WeightUpdate,
)


@runtime_checkable
class TrainerEngine(Protocol):
    """Computes losses and gradients and steps the optimizer (Tinker's TrainingClient surface)."""

    capabilities: TrainerCapabilities

    @property
    def weight_version(self) -> int:
        """Number of optimizer steps taken (0 = the initial weights)."""

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        """Loss outputs (incl. per-datum target "logprobs") without touching gradients."""

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        """Forward and backward; gradients accumulate across calls until `optim_step`.

        The returned target "logprobs" are exact where the loss acts (the `mask` input when given,
        else non-zero weights/advantages); an engine may skip the output layer elsewhere and
        return 0 there. Call `forward` for the logprobs of every position."""

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        """Apply accumulated gradients (AdamW), zero them, bump the weight version."""

    def save_state(self, path: str | Path) -> None:
        """Write weights and optimizer state atomically (write, then rename)."""

    def load_state(self, path: str | Path) -> None:
        """Restore what `save_state` wrote, optimizer included."""

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """The current weights as (Hugging Face name, tensor) pairs, for weight sync."""

    def close(self) -> None: ...


@runtime_checkable
class MeasuresFlops(Protocol):
    """Optional trainer-engine capability: the hardware's peak FLOP/s, so that steps report MFU."""

    peak_flops_per_s: float | None


@runtime_checkable
class AdapterTrainer(Protocol):
    """Optional trainer-engine capability: many LoRA adapters on its one frozen model. Each
    adapter is a trainer engine of its own (optimizer state, gradients, weight version, saved
    states) sharing the base weights, so many training runs fit where one full copy does."""

    def open_adapter(self, name: str, lora: LoraConfig, seed: int = 0) -> AdapterEngine:
        """A new adapter (it starts as the base model); closing the engine removes it."""

    def forward_backward_adapters(
        self,
        calls: Sequence[tuple[AdapterEngine, Sequence[Datum]]],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> list[ForwardBackwardOutput]:
        """`forward_backward` of several adapters' data in shared passes: each gets what it would
        alone."""


@runtime_checkable
class AdapterEngine(TrainerEngine, Protocol):
    def load_state(self, path: str | Path, optimizer: bool = True) -> None:
        """`TrainerEngine.load_state`; `optimizer=False` restores the weights alone (fresh AdamW
        state)."""


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples completions token-in-token-out, and takes weight updates."""

    @property
    def weight_version(self) -> int: ...

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        """`num_samples` completions of `prompt`, each with per-token logprobs, stop reason and
        the weight version of every token."""

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        """Logprob of every prompt token given its prefix; index 0 is None."""

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating: "abort" ends in-flight requests with what they have, "keep" holds
        them to continue after `resume`, "wait" lets them finish first."""

    async def resume(self) -> None: ...

    async def apply_weights(self, update: WeightUpdate) -> None:
        """Load new weights; later tokens are tagged with `update.version`."""

    async def health(self) -> EngineHealth: ...

    async def close(self) -> None: ...


@runtime_checkable
class WeightSync(Protocol):
    """Moves weights from a trainer to inference engines: payload x transport x layout."""

    async def push(
        self, trainer: TrainerEngine, engines: Sequence[InferenceEngine], version: int
    ) -> SyncStats:
        """Send the trainer's current weights as `version`; raise WeightSyncError on timeout or
        checksum mismatch, naming the peer."""


@runtime_checkable
class ClosableWeightSync(Protocol):
    """Optional weight-sync capability: release what it holds (a process group, files) at the
    end."""

    async def close(self) -> None: ...


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer renderers rely on."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def __len__(self) -> int: ...


@runtime_checkable
class Renderer(Protocol):
    """Turns chat messages into tokens and sampled tokens back into messages."""

    tokenizer: Tokenizer

    @property
    def has_extension_property(self) -> bool:
        """True when rendering a conversation's first n messages (with the generation prompt and
        the sampled completion) is always a token prefix of rendering more of it."""

    def build_generation_prompt(
        self,
        messages: Sequence[Message],
        role: str = "assistant",
        prefill: str | None = None,
        tools: Sequence[ToolSpec] | None = None,
    ) -> ModelInput:
        """The prompt that asks the model for its next `role` message. `tools` are shown to the
        model the way the model family expects (e.g. in the system block)."""

    def build_supervised_example(
        self,
        messages: Sequence[Message],
        train_on: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
        tools: Sequence[ToolSpec] | None = None,
    ) -> tuple[ModelInput, list[float]]:
        """The full token sequence and a weight per token (1 = train on it)."""

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        """The assistant message in sampled tokens (tool calls parsed). A response whose tool
        call cannot be read is MALFORMED, and its message keeps the raw text as content."""

    def stop_sequences(self) -> list[int] | list[str]: ...

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int] | None:
        """Tokens that continue `prev_prompt_ids + prev_completion_ids` with `new_messages` and a
        fresh generation prompt, reusing the previous ids verbatim; None when that is unsafe.

        The result starts with the previous ids unchanged. When the completion was cut off, the
        end of the turn (e.g. `</think>`, `<|im_end|>`) is synthesised after it. None means the
        model's own template would show the model something else next (it rewrites history, or
        the completion cannot be closed cleanly); the caller then re-renders, and training data
        starts a new datum there."""


@runtime_checkable
class EnvSession(Protocol):
    """One episode of an environment (one ORS session)."""

    async def prompt(self) -> list[Block]: ...

    async def messages(self) -> list[Message]:
        """The opening chat messages (by default the prompt as one user message)."""

    async def tools(self) -> list[ToolSpec]: ...

    async def terminal_tool(self) -> ToolSpec | None:
        """A tool that a plain (tool-call-free) assistant answer is passed to, or None."""

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput | ToolError:
        """Run a tool. Failures come back as ToolError, never as exceptions."""

    async def close(self) -> None:
        """Tear the episode down; always safe to call, also twice."""


@runtime_checkable
class Environment(Protocol):
    """Tasks in named splits, and sessions opened on a task. Never sees tokens."""

    name: str

    async def splits(self) -> list[Split]: ...

    async def num_tasks(self, split: str) -> int: ...

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        """The task at `index`; the same index always gives the same task."""

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> EnvSession: ...

    async def close(self) -> None: ...
