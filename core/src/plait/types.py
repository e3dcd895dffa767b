"""Data types shared by every plait component.

The training surface follows the Tinker API (ModelInput, Datum, TensorData, SamplingParams,
AdamParams, ForwardBackwardOutput); the environment surface follows the Open Reward Standard
(TextBlock, ImageBlock, ToolOutput, ToolSpec, Split). Everything is an attrs class that converts
to and from plain JSON-able dicts with `to_json` / `from_json` (see `plait.serde`).

Nothing here imports torch: tensors travel as `TensorData` (a numpy array plus dtype).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from plait.errors import DataError

# -- Model input and tensors ------------------------------------------------------------------


def _int_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens)


def _float_tuple(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@attrs.frozen
class EncodedTextChunk:
    """A run of token ids."""

    tokens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


ModelInputChunk = EncodedTextChunk


@attrs.frozen
class ModelInput:
    """The input of a model: a sequence of chunks (only token chunks today)."""

    chunks: tuple[ModelInputChunk, ...] = attrs.field(
        converter=tuple[ModelInputChunk, ...], factory=tuple
    )

    @classmethod
    def from_ints(cls, tokens: Iterable[int]) -> ModelInput:
        return cls((EncodedTextChunk(tokens),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(())

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: ModelInputChunk) -> ModelInput:
        return ModelInput((*self.chunks, chunk))

    def append_ints(self, tokens: Iterable[int]) -> ModelInput:
        return self.append(EncodedTextChunk(tokens))


TensorDType = Literal["int64", "float32", "uint8", "uint16", "int32"]
"""Tinker's two dtypes, and the narrow integer ones of compact ids (e.g. routed experts)."""
_NUMPY_DTYPES: dict[str, Any] = {
    "int64": np.int64,
    "float32": np.float32,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "int32": np.int32,
}


def prompt_token_ids(prompt: ModelInput, vocab_size: int) -> list[int]:
    """The prompt's token ids, checked: a ModelInput, not empty, every id in the vocabulary."""
    if not isinstance(prompt, ModelInput):
        raise DataError(
            f"prompt must be a plait.types.ModelInput, got {type(prompt).__name__}",
            fix="wrap token ids with ModelInput.from_ints(ids)",
        )
    ids = prompt.to_ints()
    if not ids:
        raise DataError(
            "empty prompt: sampling needs at least one prompt token",
            fix="render the prompt with the renderer (it starts with the chat template's tokens)",
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DataError(
            f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab_size}",
            fix="tokenize with the model's own tokenizer",
        )
    return ids


@attrs.frozen(eq=False)
class TensorData:
    """A dense tensor that travels between components: flattened data, dtype and shape."""

    data: np.ndarray
    dtype: TensorDType
    shape: tuple[int, ...]

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        dtype: TensorDType = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        array = array.astype(_NUMPY_DTYPES[dtype], copy=False)
        return cls(array.reshape(-1), dtype, tuple(array.shape))

    @classmethod
    def compact(cls, ids: np.ndarray) -> TensorData:
        """Non-negative integer ids in the narrowest of uint8, uint16 and int32 that holds them."""
        ids = np.asarray(ids)
        top = int(ids.max()) if ids.size else 0
        dtype: TensorDType = "uint8" if top < 1 << 8 else "uint16" if top < 1 << 16 else "int32"
        return cls(ids.astype(_NUMPY_DTYPES[dtype]).reshape(-1), dtype, tuple(ids.shape))

    @classmethod
    def from_list(cls, values: Sequence[Any], dtype: TensorDType) -> TensorData:
        array = np.asarray(values, dtype=_NUMPY_DTYPES[dtype])
        return cls(array.reshape(-1), dtype, tuple(array.shape))

    def to_numpy(self) -> np.ndarray:
        return self.data.reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.to_numpy().tolist()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorData)
            and self.dtype == other.dtype
            and self.shape == other.shape
            and bool(np.array_equal(self.data, other.data))
        )

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


# Default dtypes of loss_fn_inputs keys (Tinker's): integers for targets, floats for the rest.
_INT_KEYS = frozenset({"target_tokens"})


def _to_tensor_data(key: str, value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value
    if hasattr(value, "detach") and hasattr(
        value, "cpu"
    ):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    if key == "routed_experts":
        return TensorData.compact(value)
    dtype: TensorDType = "int64" if key in _INT_KEYS else "float32"
    return TensorData.from_list(value, dtype)


def _loss_inputs(values: Mapping[str, Any]) -> dict[str, TensorData]:
    return {key: _to_tensor_data(key, value) for key, value in values.items()}


@attrs.frozen
class Datum:
    """One training example: the model input and the per-position inputs of the loss.

    Position i of `model_input` predicts `loss_fn_inputs["target_tokens"][i]` (next-token
    alignment: input = seq[:-1], targets = seq[1:]). Every loss input has shape (N,) with
    N = model_input.length. Lists, numpy arrays and torch tensors are coerced.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = attrs.field(converter=_loss_inputs)

    def __attrs_post_init__(self) -> None:
        n = self.model_input.length
        for key, tensor in self.loss_fn_inputs.items():
            if tensor.shape[:1] != (n,):
                raise ValueError(
                    f"Datum.loss_fn_inputs[{key!r}] has shape {tensor.shape}, expected ({n},) "
                    "to match model_input.length"
                )


# -- Sampling ---------------------------------------------------------------------------------


StopSpec = str | tuple[str, ...] | tuple[int, ...] | None


def _stop_tuple(stop: StopSpec | list[str] | list[int]) -> StopSpec:
    return tuple(stop) if isinstance(stop, list) else stop  # type: ignore[return-value]  # mypy joins list[str] | list[int] to tuple[object, ...]


@attrs.frozen
class SamplingParams:
    """How to sample. `stop=None` keeps the end-of-sequence token as a stop; `stop=[]` disables
    it."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: StopSpec = attrs.field(default=None, converter=_stop_tuple)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    grammar: str | None = None
    """A GBNF grammar (xgrammar EBNF) the completion must match; stop tokens end it only there."""
    top_logprobs: int = 0
    """Also return each sampled token's `top_logprobs` most likely tokens (raw logprobs)."""

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.top_logprobs < 0:
            raise ValueError(f"SamplingParams.top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")


StopReason = Literal["stop", "length", "abort"]


@attrs.frozen
class SampledSequence:
    """One sampled completion, exactly as the inference engine produced it.

    `tokens` include the stop token when the sequence stopped on one. `weight_version` is the
    version of the weights that produced the *last* token; `token_versions`, when set, gives the
    version of every token (they differ when weights were updated in flight). `routed_experts`
    (MoE models, when the engine is asked for it) holds the experts that routed every token the
    engine ran, prompt and completion but the last token: shape (tokens - 1, layers, top_k).
    `replica`: the pool's replica.
    """

    tokens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    logprobs: tuple[float, ...] = attrs.field(converter=_float_tuple)
    stop_reason: StopReason
    weight_version: int = 0
    token_versions: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_int_tuple)
    )
    routed_experts: TensorData | None = None
    replica: str | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """Per sampled token, (token, raw logprob) of the `SamplingParams.top_logprobs` most likely;
    None when not asked for or when the engine does not compute them."""

    def __attrs_post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(
                f"SampledSequence has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.tokens):
            raise ValueError("SampledSequence.token_versions must have one entry per token")

    def versions(self) -> tuple[int, ...]:
        """The weight version of every token."""
        return self.token_versions or (self.weight_version,) * len(self.tokens)


@attrs.frozen
class SampleResponse:
    sequences: tuple[SampledSequence, ...] = attrs.field(converter=tuple[SampledSequence, ...])
    prompt_logprobs: tuple[float | None, ...] | None = None


# -- Training ---------------------------------------------------------------------------------


@attrs.frozen
class AdamParams:
    """AdamW hyper-parameters for one optimizer step: Tinker's, with its defaults except `eps`,
    1e-8 (PyTorch's, and what tinker-cookbook's training steps pass) where Tinker's SDK has 1e-12.
    A run config's `[trainer]` table takes its beta1, beta2, eps and weight_decay defaults from
    here; its learning rate and clipping are the run's own (1e-5, 1.0)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


@attrs.frozen
class ForwardBackwardOutput:
    """Per-datum loss outputs (e.g. "logprobs" of the targets) and merged metrics.

    Metric keys are "name:reduction" with reduction in {sum, mean, max, min}.
    """

    loss_fn_output_type: str
    loss_fn_outputs: tuple[dict[str, TensorData], ...] = attrs.field(
        converter=tuple[dict[str, TensorData], ...]
    )
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen
class OptimStepResult:
    """Metrics of one optimizer step; `grad_norm` is measured before clipping."""

    weight_version: int
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen
class TrainerCapabilities:
    """Optional trainer features, declared rather than guessed."""

    packing: bool = False
    prefix_sharing: bool = False
    activation_checkpointing: bool = False
    routing_replay: bool = False
    lora: bool = False
    value_head: bool = False
    """A value model (a run's critic): forward gives "values" where a policy gives "logprobs"."""


@attrs.frozen
class LoraConfig:
    """One LoRA adapter: its rank and scale (alpha / rank) and which layers it adapts (Tinker's
    `lora_config`: attention, MLP, the unembedding)."""

    rank: int = 32
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False


# -- Weight sync ------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class WeightUpdate:
    """Weights on their way from a trainer to an inference engine.

    `tensors` maps Hugging Face parameter names to tensors (any array type the receiver accepts).
    With `kind="delta"`, `tensors` maps names to changes of some tensors, in plait-weights' delta
    format (`plait_weights.delta.TensorPatch`); `base_version`, when set, is the version the
    receiver must hold for the patches to apply (sparse patches change a known base; dense
    entries do not need one). `checksum`, when set, is `plait_weights.patch.checksum` of every
    tensor the update names, as they must be after it applies: a receiver that holds other bits
    must refuse the update loudly. `base_checksum` is the checksum of the tensors whose patches
    are `bit_steps`, as they must be *before* it applies (required for such patches: a receiver
    checks it before writing anything).
    """

    version: int
    tensors: Mapping[str, Any]
    kind: Literal["full", "delta"] = "full"
    checksum: str | None = None
    base_version: int | None = None
    base_checksum: str | None = None


@attrs.frozen
class SyncStats:
    """One push: bytes sent, wall seconds, the fraction of elements sent (1 for full payloads),
    and `full_bytes`, what a full push in the same dtype would have sent (0 = not measured)."""

    version: int
    bytes: int
    seconds: float
    delta_fraction: float = 1.0
    full_bytes: int = 0


PauseMode = Literal["abort", "keep", "wait"]


@attrs.frozen
class EngineHealth:
    ok: bool
    weight_version: int
    detail: str = ""


# -- Chat messages (renderer surface) ---------------------------------------------------------


@attrs.frozen
class ToolCall:
    """A tool call the model made (or is shown to have made)."""

    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)
    id: str | None = None


@attrs.frozen
class Message:
    """A chat message, as renderers consume and produce it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = attrs.field(factory=tuple, converter=tuple[ToolCall, ...])
    tool_call_id: str | None = None
    name: str | None = None


class ParseTermination(enum.Enum):
    """How a sampled response ended, as the renderer parsed it."""

    STOP_SEQUENCE = "stop_sequence"
    EOS = "eos"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"

    @property
    def is_clean(self) -> bool:
        return self in (ParseTermination.STOP_SEQUENCE, ParseTermination.EOS)


class TrainOnWhat(enum.Enum):
    LAST_ASSISTANT_MESSAGE = "last_assistant_message"
    ALL_ASSISTANT_MESSAGES = "all_assistant_messages"
    ALL_MESSAGES = "all_messages"
    ALL_TOKENS = "all_tokens"


# -- Environments (ORS surface) ---------------------------------------------------------------


@attrs.frozen
class TextBlock:
    text: str
    type: Literal["text"] = "text"
    detail: dict[str, Any] | None = None


@attrs.frozen
class ImageBlock:
    data: str  # base64
    mimeType: str
    type: Literal["image"] = "image"
    detail: dict[str, Any] | None = None


Block = TextBlock | ImageBlock


@attrs.frozen
class ToolOutput:
    """What a tool call returns: observation blocks, an optional reward, and the finished flag."""

    blocks: tuple[Block, ...] = attrs.field(factory=tuple, converter=tuple[Block, ...])
    reward: float | None = None
    finished: bool = False
    metadata: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return blocks_text(self.blocks)


ToolErrorReason = Literal[
    "not_found", "name_collision", "input_validation", "episode_finished", "exception"
]


@attrs.frozen
class ToolError:
    """A tool call that did not produce output. Returned, never raised, so a rollout can go on."""

    error: str
    reason: ToolErrorReason = "exception"


@attrs.frozen
class ToolSpec:
    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None


@attrs.frozen
class Split:
    name: str
    type: Literal["train", "validation", "test"] = "train"


def blocks_text(blocks: Iterable[Block]) -> str:
    """The text of a list of blocks (images are left out)."""
    return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
