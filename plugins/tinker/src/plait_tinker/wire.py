"""The Tinker SDK's bodies to plait's types and back: protobuf for forward_backward requests and
for the results of forward_backward and sample (`tinker_wire.proto`), JSON for the rest.

A malformed body is a `WireError` naming the field, answered as the client's error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from google.protobuf.message import DecodeError

from plait.api import (
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    SampleResponse,
    SamplingParams,
    TensorData,
)
from plait_tinker import tinker_wire_pb2 as pb

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_PROTO_DTYPE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}


class WireError(ValueError):
    """A request the server cannot read; the message says which part and why."""


@attrs.frozen
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(
            f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})"
        ) from None
    config = {key: float(value) for key, value in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise WireError(
                f"forward_backward: loss_fn_config[{key!r}] is text ({value.text!r}); "
                "the losses here take numbers only"
            )
        config[key] = value.number
    data = [_datum(datum, i) for i, datum in enumerate(request.data)]
    if not request.model_id or not data:
        raise WireError("forward_backward: model_id and data are required")
    return ForwardBackwardCall(
        request.model_id,
        request.seq_id,
        data,
        request.loss_fn or "cross_entropy",
        config,
        request.forward_only,
    )


def _datum(datum: pb.Datum, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(
                f"data[{index}]: a {chunk.WhichOneof('chunk')} chunk; "
                "this server takes token chunks only"
            )
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    inputs = {
        key: _tensor(tensor, f"data[{index}].loss_fn_inputs[{key!r}]")
        for key, tensor in datum.loss_fn_inputs.items()
    }
    try:
        return Datum(ModelInput.from_ints(tokens), inputs)
    except ValueError as exc:
        raise WireError(f"data[{index}]: {exc}") from None


def _tensor(tensor: pb.Tensor, where: str) -> TensorData:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(
            f"{where}: dtype {pb.DType.Name(tensor.dtype)} is not float32, int64 or int32"
        )
    shape = tuple(tensor.shape)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        if len(shape) != 2:
            raise WireError(f"{where}: a sparse tensor must be 2-D, got shape {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        if (
            len(rows) != shape[0] + 1
            or len(cols) != len(values)
            or (len(cols) and cols.max() >= shape[1])
        ):
            raise WireError(f"{where}: sparse indices do not fit shape {shape}")
        array = np.zeros(shape, dtype=dtype)
        array[np.repeat(np.arange(shape[0]), np.diff(rows)), cols] = values
    else:
        array = np.frombuffer(tensor.dense, dtype=dtype)
        if shape and int(np.prod(shape)) != array.size:
            raise WireError(f"{where}: {array.size} values do not fill shape {shape}")
        array = array.reshape(shape or (array.size,))
    return TensorData.from_numpy(array.astype(np.int64) if array.dtype == np.int32 else array)


def write_forward_backward(output: ForwardBackwardOutput) -> bytes:
    """One batched ArrayRecord: every field's datums concatenated, with byte offsets."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in output.metrics.items():
        message.metrics[metric_key(key)] = float(value)
    record = message.loss_fn_outputs.add(
        type_tag="ArrayRecord", num_datums=len(output.loss_fn_outputs)
    )
    for name in output.loss_fn_outputs[0] if output.loss_fn_outputs else ():
        arrays = [
            np.ascontiguousarray(np.asarray(out[name].to_numpy(), dtype=_numpy_of(out[name].dtype)))
            for out in output.loss_fn_outputs
        ]
        sizes = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=sizes.tobytes(),
                dtype=_PROTO_DTYPE[_public_dtype(output.loss_fn_outputs[0][name].dtype)],
                trailing_shape=list(arrays[0].shape[1:]),
            )
        )
    return message.SerializeToString()


def _public_dtype(dtype: str) -> str:
    return "float32" if dtype.startswith("float") else "int64"


def _numpy_of(dtype: str) -> Any:
    return np.float32 if _public_dtype(dtype) == "float32" else np.int64


REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


def metric_key(key: str) -> str:
    """The SDK splits every key into `name:reduction` (exactly one colon) to merge chunked
    results; a key without a reduction it knows is a mean."""
    name, _, reduction = key.rpartition(":")
    if name and ":" not in name and reduction in REDUCTIONS:
        return key
    return key.replace(":", "_") + ":mean"


def write_sample(
    response: SampleResponse, prompt_logprobs: Sequence[float | None] | None, top_k: int = 0
) -> bytes:
    """`top_k`: each sequence's `top_logprobs` go out as the SDK's (tokens, k) TopkLogprobs."""
    message = pb.SampleResponse()
    for seq in response.sequences:
        sequence = message.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH
            if seq.stop_reason == "length"
            else pb.STOP_REASON_STOP,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if top_k and seq.top_logprobs is not None:
            pairs = np.asarray(seq.top_logprobs, dtype=np.float64).reshape(-1, top_k, 2)
            sequence.topk_sampled_logprobs.CopyFrom(
                pb.TopkLogprobs(
                    token_ids=pairs[..., 0].astype(np.int32).tobytes(),
                    logprobs=pairs[..., 1].astype(np.float32).tobytes(),
                    k=top_k,
                    length=len(pairs),
                )
            )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(
            [np.nan if v is None else v for v in prompt_logprobs], dtype=np.float32
        ).tobytes()
    return message.SerializeToString()


def model_input(body: Mapping[str, Any], where: str = "prompt") -> ModelInput:
    chunks = body.get("chunks") if isinstance(body, Mapping) else None
    if not isinstance(chunks, list):
        raise WireError(f'{where}: expected {{"chunks": [...]}}')
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, Mapping) or chunk.get("type", "encoded_text") != "encoded_text":
            raise WireError(f"{where}.chunks[{i}]: this server takes encoded_text chunks only")
        if not all(isinstance(t, int) and t >= 0 for t in chunk.get("tokens", ())):
            raise WireError(f"{where}.chunks[{i}].tokens: expected non-negative integers")
        tokens += chunk["tokens"]
    if not tokens:
        raise WireError(f"{where}: the prompt is empty")
    return ModelInput.from_ints(tokens)


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    fields = {
        key: body[key]
        for key in ("max_tokens", "seed", "stop", "temperature", "top_k", "top_p")
        if body.get(key) is not None
    }
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise WireError(f"sampling_params: {exc}") from None
