"""The "torch" trainer engine: any Hugging Face causal LM, on the CPU or one CUDA device.

Data follow the Tinker surface: position i of a datum's `model_input` predicts
`loss_fn_inputs["target_tokens"][i]`. A call's data are split into micro-batches of at most
`options.micro_batch_tokens` padded tokens (rows sorted by length, right-padded, so padding never
reaches a real position through causal attention); padding positions get zero loss inputs and
zero target logprobs, so every token-sum loss ignores them. Gradients accumulate across
`forward_backward` calls until `optim_step`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog
import torch

from plait.errors import DataError, ModelError
from plait.losses import LossOutput, check_inputs
from plait.metrics import merge_metrics
from plait.models import ResolvedModel
from plait.plugins import get_registry
from plait.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepResult,
    TensorData,
    TrainerCapabilities,
)
from plait_torch import loading
from plait_torch.ops import head_logprobs, target_logprobs, token_entropy
from plait_torch.options import TorchTrainerOptions
from plait_torch.perf import FlopsModel, PeakFlops, peak_flops

log = structlog.get_logger("plait_torch.trainer")

STATE_FORMAT = 1
_STATE_FILE = "trainer_state.pt"
_META_FILE = "plait_trainer.json"
# Loss inputs that hold token ids; every other loss input is a float tensor.
_INT_INPUTS = frozenset({"target_tokens"})


@attrs.frozen
class _MicroBatch:
    indices: list[int]  # positions in the caller's data list
    input_ids: torch.Tensor  # (B, T) long, right-padded with 0
    valid: torch.Tensor  # (B, T) bool, False on padding
    inputs: dict[str, torch.Tensor]  # (B, T) per loss input, 0 on padding
    lengths: list[int]


class TorchTrainer:
    """`plait.protocols.TrainerEngine` on PyTorch + transformers."""

    capabilities = TrainerCapabilities(activation_checkpointing=True)

    def __init__(self, model: ResolvedModel, *, options: TorchTrainerOptions | None = None, seed: int = 0) -> None:
        self.options = options or TorchTrainerOptions()
        self.model_info = model
        loading.set_threads(self.options.threads)
        torch.manual_seed(seed)
        self.device = loading.select_device(self.options.device)
        dtype = loading.model_dtype(model)
        # bfloat16 models train with float32 master weights under autocast unless told otherwise.
        self._autocast_dtype = dtype if dtype != torch.float32 and self.options.mixed_precision else None
        param_dtype = torch.float32 if self._autocast_dtype is not None else dtype
        self.tokenizer = loading.load_tokenizer(model.tokenizer_path)
        self.model = loading.load_causal_lm(model, dtype=param_dtype, device=self.device,
                                            attn_implementation=self.options.attn_implementation)
        loading.check_tokenizer_fits(self.tokenizer, self.model, model)
        self.model.config.use_cache = False
        if self.options.activation_checkpointing:
            _enable_activation_checkpointing(self.model)
        self.model.train()
        self.vocab_rows = loading.embedding_rows(self.model)
        self._decoder, self._head = self._split_output_head()
        self.flops = FlopsModel.of(self.model)
        self._params = dict(self.model.named_parameters())  # tied parameters appear once
        first = AdamParams()
        self.optimizer = torch.optim.AdamW(
            list(self._params.values()), lr=first.learning_rate, betas=(first.beta1, first.beta2),
            eps=first.eps, weight_decay=first.weight_decay,
        )
        self._weight_version = 0
        log.info("trainer ready", model=model.name, device=str(self.device), dtype=str(param_dtype),
                 params=sum(p.numel() for p in self._params.values()))

    # -- protocol ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def peak_flops(self) -> PeakFlops:
        """Peak matmul FLOP/s of this trainer's device in its compute dtype (measured once per
        process on a CPU, from a datasheet table on known GPUs), with where the number came from."""
        dtype = self._autocast_dtype or next(iter(self._params.values())).dtype
        return peak_flops(self.device.type, dtype)

    @property
    def peak_flops_per_s(self) -> float:
        return self.peak_flops.flops_per_s

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token of a sequence of `seq_len` tokens."""
        return self.flops.train_flops_per_token(seq_len)

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        with torch.no_grad():
            return self._run(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, loss_fn_config, backward=True)

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        params = [p for p in self._params.values() if p.grad is not None]
        if not params:
            log.warning("optim_step without accumulated gradients; weights stay as they are")
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        grad_norm = float(total_norm)
        metrics = {"grad_norm": grad_norm, "lr": float(adam_params.learning_rate)}
        if not math.isfinite(grad_norm):
            # One bad batch must not poison the weights: drop its gradients, keep the old weights.
            log.warning("non-finite gradient norm; skipping the update", grad_norm=grad_norm)
            metrics["skipped"] = 1.0
        else:
            if adam_params.grad_clip_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, adam_params.grad_clip_norm, total_norm)
            for group in self.optimizer.param_groups:
                group.update(lr=adam_params.learning_rate, betas=(adam_params.beta1, adam_params.beta2),
                             eps=adam_params.eps, weight_decay=adam_params.weight_decay)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._weight_version += 1
        return OptimStepResult(self._weight_version, metrics)

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor) for every parameter (tied ones once, under their first name).

        The tensors are the live parameters, detached: valid until the next `optim_step` or
        `load_state`; copy them to keep them longer.
        """
        for name, param in self._params.items():
            yield name, param.detach()

    def save_state(self, path: str | Path) -> None:
        """Weights (a Hugging Face checkpoint), optimizer state, pending gradients, weight version
        and RNG state, written to a temporary directory, fsynced, then renamed into place."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            self.model.save_pretrained(str(tmp), safe_serialization=True)
            torch.save({
                "optimizer": self.optimizer.state_dict(),
                "grads": {n: p.grad.detach().cpu() for n, p in self._params.items() if p.grad is not None},
                "rng": _rng_state(),
            }, tmp / _STATE_FILE)
            (tmp / _META_FILE).write_text(json.dumps({
                "format": STATE_FORMAT, "weight_version": self._weight_version, "model": self.model_info.name,
                "parameters": {n: list(p.shape) for n, p in self._params.items()}, "saved_at": time.time(),
            }, indent=1))
            _fsync_tree(tmp)
            _replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("trainer state saved", path=str(path), weight_version=self._weight_version)

    def load_state(self, path: str | Path) -> None:
        path = Path(path)
        meta_path = path / _META_FILE
        if not meta_path.is_file():
            raise ModelError(f"{path} is not a plait-torch trainer state (no {_META_FILE})",
                             fix="pass a directory written by save_state")
        meta = json.loads(meta_path.read_text())
        saved = meta["parameters"]
        expected = {n: list(p.shape) for n, p in self._params.items()}
        differing = sorted(n for n in saved.keys() | expected.keys() if saved.get(n) != expected.get(n))
        if differing:
            raise ModelError(
                f"trainer state {path} was saved from a different model: {len(differing)} parameters differ "
                f"in name or shape, e.g. {differing[:3]}",
                fix="load it into a trainer built on the same model")
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(file)))
        missing = sorted(set(self._params) - set(weights))
        if missing:
            raise ModelError(f"trainer state {path} lacks weights {missing[:5]}", fix="save the state again")
        with torch.no_grad():
            for name, param in self._params.items():
                param.copy_(weights[name])
        # On the CPU: RNG states must stay CPU tensors; the optimizer moves its state to the parameters.
        state = torch.load(path / _STATE_FILE, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        for name, param in self._params.items():
            grad = state["grads"].get(name)
            param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
        _set_rng_state(state["rng"])
        self._weight_version = int(meta["weight_version"])
        log.info("trainer state loaded", path=str(path), weight_version=self._weight_version)

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._params.clear()
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- internals --------------------------------------------------------------------------

    def _run(self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
             *, backward: bool) -> ForwardBackwardOutput:
        loss = _lookup_loss(loss_fn)
        keys = _check_data(data, loss_fn)
        config = dict(loss_fn_config or {})
        outputs: list[dict[str, TensorData]] = [{} for _ in data]
        parts: list[tuple[dict[str, float], int]] = []
        tokens = 0
        flops = 0.0
        for batch in self._micro_batches(data, keys):
            loss_out, logprobs, entropy_sum, active = self._micro_batch(batch, loss, loss_fn, config, backward)
            chunk_metrics = dict(loss_out.metrics)
            if active:
                chunk_metrics["entropy:mean"] = entropy_sum / active
            parts.append((chunk_metrics, active))
            for row, index in enumerate(batch.indices):
                outputs[index] = {"logprobs": TensorData.from_torch(logprobs[row, : batch.lengths[row]])}
            for length in batch.lengths:
                tokens += length
                per_token = self.flops.train_flops_per_token(length) if backward else self.flops.forward_flops_per_token(length)
                flops += per_token * length
        metrics = merge_metrics(parts)
        metrics["model_flops:sum"] = flops
        if backward:
            metrics["train_tokens:sum"] = float(tokens)
        return ForwardBackwardOutput(loss_fn_output_type=loss_fn, loss_fn_outputs=outputs, metrics=metrics)

    def _micro_batches(self, data: Sequence[Datum], keys: Sequence[str]) -> Iterator[_MicroBatch]:
        lengths = [d.model_input.length for d in data]
        order = sorted(range(len(data)), key=lambda i: -lengths[i])
        budget = self.options.micro_batch_tokens
        group: list[int] = []
        for index in order:
            # Longest first, so the first row of a group sets its padded width.
            if group and (len(group) + 1) * lengths[group[0]] > budget:
                yield self._pad([data[i] for i in group], group, keys)
                group = []
            group.append(index)
        if group:
            yield self._pad([data[i] for i in group], group, keys)

    def _pad(self, data: Sequence[Datum], indices: list[int], keys: Sequence[str]) -> _MicroBatch:
        lengths = [d.model_input.length for d in data]
        width = max(lengths)
        ids = np.zeros((len(data), width), dtype=np.int64)
        valid = np.zeros((len(data), width), dtype=bool)
        inputs = {k: np.zeros((len(data), width), dtype=np.int64 if k in _INT_INPUTS else np.float32) for k in keys}
        for row, datum in enumerate(data):
            n = lengths[row]
            ids[row, :n] = datum.model_input.to_ints()
            valid[row, :n] = True
            for key in keys:
                inputs[key][row, :n] = datum.loss_fn_inputs[key].to_numpy()
        to = self.device
        batch = _MicroBatch(indices, torch.from_numpy(ids).to(to), torch.from_numpy(valid).to(to),
                            {k: torch.from_numpy(v).to(to) for k, v in inputs.items()}, lengths)
        loading.check_token_ids(batch.input_ids, self.vocab_rows, "model_input")
        loading.check_token_ids(batch.inputs["target_tokens"], self.vocab_rows, "loss_fn_inputs['target_tokens']")
        return batch

    def _micro_batch(self, batch: _MicroBatch, loss: Any, loss_name: str, config: dict[str, float],
                     backward: bool) -> tuple[LossOutput, torch.Tensor, float, int]:
        autocast = (torch.autocast(self.device.type, dtype=self._autocast_dtype)
                    if self._autocast_dtype is not None else contextlib.nullcontext())
        active = _active_tokens(batch)
        with autocast:
            # No attention mask: rows are right-padded, and causal attention never lets a real
            # position see the padding after it.
            if self._decoder is not None:
                hidden = self._decoder(input_ids=batch.input_ids, use_cache=False).last_hidden_state
                # A backward pass needs logprobs only where the loss acts; skipping the output head
                # elsewhere (mostly the prompt) saves most of its cost for large vocabularies.
                rows, cols = (active if backward else batch.valid).nonzero(as_tuple=True)
                flat, entropy = head_logprobs(hidden[rows, cols], self._head.weight,
                                              batch.inputs["target_tokens"][rows, cols])
                logprobs = flat.new_zeros(batch.valid.shape).index_put((rows, cols), flat)
                entropy_sum = float(entropy[active[rows, cols]].sum())
            else:
                logits = self.model(input_ids=batch.input_ids, use_cache=False).logits
                logprobs = target_logprobs(logits, batch.inputs["target_tokens"])
                logprobs = torch.where(batch.valid, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
                with torch.no_grad():
                    entropy_sum = float(token_entropy(logits.detach(), active).sum())
        try:
            out: LossOutput = loss(logprobs, batch.inputs, config)
        except (ValueError, KeyError) as exc:
            raise DataError(f"loss {loss_name!r} rejected its inputs: {exc}",
                            fix="give every datum the loss_fn_inputs and loss_fn_config the loss documents") from exc
        if backward:
            out.loss.backward()
        return out, logprobs.detach(), entropy_sum, int(active.sum())

    def _split_output_head(self) -> tuple[Any, Any]:
        """(decoder, output projection) when logits are exactly `decoder(x) @ head.weight.T`, so the
        chunked output head applies; (None, None) for models that scale, cap or bias their logits."""
        head = self.model.get_output_embeddings()
        decoder = self.model.get_decoder()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None or decoder is self.model:
            return None, None
        probe = torch.arange(1, 9, device=self.device).unsqueeze(0) % self.vocab_rows
        with torch.no_grad():
            expected = self.model(input_ids=probe, use_cache=False).logits.float()
            hidden = decoder(input_ids=probe, use_cache=False).last_hidden_state
            actual = hidden.float() @ head.weight.float().T
        tolerance = 1e-4 if head.weight.dtype == torch.float32 else 5e-2
        if not torch.allclose(actual, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()):
            log.info("the model transforms its logits; using the full-logits path", model=self.model_info.name)
            return None, None
        return decoder, head


def _enable_activation_checkpointing(hf_model: Any) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _active_tokens(batch: _MicroBatch) -> torch.Tensor:
    """Positions the loss acts on: the `mask` input if given, else non-zero weights/advantages."""
    for key, test in (("mask", lambda t: t > 0), ("weights", lambda t: t != 0), ("advantages", lambda t: t != 0)):
        if key in batch.inputs:
            return test(batch.inputs[key]) & batch.valid
    return batch.valid


def _lookup_loss(name: str) -> Any:
    return get_registry().get("loss", name).load()


def _check_data(data: Sequence[Datum], loss_fn: str) -> list[str]:
    if not data:
        raise DataError("no data: forward/forward_backward needs at least one Datum",
                        fix="skip the call when a batch is empty")
    keys = sorted(data[0].loss_fn_inputs)
    for index, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise DataError(f"data[{index}] is a {type(datum).__name__}, not a plait.types.Datum")
        if datum.model_input.length == 0:
            raise DataError(f"data[{index}] has an empty model_input", fix="drop empty sequences before training")
        if sorted(datum.loss_fn_inputs) != keys:
            raise DataError(
                f"data[{index}] has loss_fn_inputs {sorted(datum.loss_fn_inputs)} but data[0] has {keys}",
                fix="give every datum of one call the same loss_fn_inputs keys")
    if "target_tokens" not in keys:
        raise DataError(f"loss {loss_fn!r} needs loss_fn_inputs['target_tokens']; the data have {keys}",
                        fix="add target_tokens (the input shifted by one: targets = seq[1:])")
    try:
        check_inputs(loss_fn, keys)
    except ValueError as exc:
        raise DataError(str(exc), fix="add the missing loss_fn_inputs to every datum") from None
    return keys


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for file in root.rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Move the complete `tmp` to `dest`. An existing `dest` is moved aside first and removed
    afterwards: a crash in between leaves the complete old state as `.NAME.old-*`, never a torn one."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        dest.rename(old)
    tmp.rename(dest)
    _fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
