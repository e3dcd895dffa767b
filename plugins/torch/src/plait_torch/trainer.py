"""The "torch" trainer engine: any Hugging Face causal LM, on the CPU or one CUDA device.

Data follow the Tinker surface: position i of a datum's `model_input` predicts
`loss_fn_inputs["target_tokens"][i]`. A call's data are laid out in micro-batches of at most
`options.micro_batch_tokens` tokens (`plait.training.layout`): packed into rows with their own
position ids and no attention across sequences, with the prefixes that datums share (a GRPO
group's prompt) computed once, or one right-padded row per datum when both are off. Every
token-sum loss sees only real positions. Gradients accumulate across `forward_backward` calls
until `optim_step`.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from plait.errors import ModelError
from plait.models import ResolvedModel
from plait.training import loading
from plait.training.checkpointing import apply_activation_checkpointing
from plait.training.layout import LayoutOptions
from plait.training.perf import FlopsModel, PeakFlops, peak_flops
from plait.training.scorer import TokenScorer
from plait.training.state import (
    fsync_tree,
    replace_dir,
    rng_state,
    set_rng_state,
    temporary_sibling,
)
from plait.training.step import StepRunner, to_output
from plait.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepResult,
    TrainerCapabilities,
)
from plait_torch.options import TorchTrainerOptions

log = structlog.get_logger("plait_torch.trainer")

STATE_FORMAT = 1
_STATE_FILE = "trainer_state.pt"
_META_FILE = "plait_trainer.json"


class TorchTrainer:
    """`plait.protocols.TrainerEngine` on PyTorch + transformers."""

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
        checkpointing = self.options.activation_checkpointing
        if checkpointing:
            apply_activation_checkpointing(self.model, "full" if checkpointing is True else checkpointing)
        self.model.train()
        self.vocab_rows = loading.embedding_rows(self.model)
        self.scorer = TokenScorer(self.model)
        layout = _layout(self.options, self.scorer)
        self.capabilities = TrainerCapabilities(packing=layout.packing, prefix_sharing=layout.prefix_sharing,
                                                activation_checkpointing=True)
        self.flops = FlopsModel.of(self.model)
        self._runner = StepRunner(self.scorer, layout=layout, device=self.device, flops=self.flops,
                                  vocab_rows=self.vocab_rows, autocast_dtype=self._autocast_dtype)
        self._params = dict(self.model.named_parameters())  # tied parameters appear once
        first = AdamParams()
        self.optimizer = torch.optim.AdamW(
            list(self._params.values()), lr=first.learning_rate, betas=(first.beta1, first.beta2),
            eps=first.eps, weight_decay=first.weight_decay,
        )
        self._weight_version = 0
        log.info("trainer ready", model=model.name, device=str(self.device), dtype=str(param_dtype),
                 params=sum(p.numel() for p in self._params.values()), packing=layout.packing,
                 prefix_sharing=layout.prefix_sharing, activation_checkpointing=checkpointing)

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
            result = self._runner.run(data, loss_fn, loss_fn_config, backward=False)
        return to_output(loss_fn, len(data), [(range(len(data)), result)])

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        result = self._runner.run(data, loss_fn, loss_fn_config, backward=True)
        return to_output(loss_fn, len(data), [(range(len(data)), result)])

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
        tmp = temporary_sibling(path)
        try:
            tmp.mkdir()
            self.model.save_pretrained(str(tmp), safe_serialization=True)
            torch.save({
                "optimizer": self.optimizer.state_dict(),
                "grads": {n: p.grad.detach().cpu() for n, p in self._params.items() if p.grad is not None},
                "rng": rng_state(),
            }, tmp / _STATE_FILE)
            (tmp / _META_FILE).write_text(json.dumps({
                "format": STATE_FORMAT, "weight_version": self._weight_version, "model": self.model_info.name,
                "parameters": {n: list(p.shape) for n, p in self._params.items()}, "saved_at": time.time(),
            }, indent=1))
            fsync_tree(tmp)
            replace_dir(tmp, path)
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
        set_rng_state(state["rng"])
        self._weight_version = int(meta["weight_version"])
        log.info("trainer state loaded", path=str(path), weight_version=self._weight_version)

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._params.clear()
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _layout(options: TorchTrainerOptions, scorer: TokenScorer) -> LayoutOptions:
    packed = options.packing or options.prefix_sharing
    if packed and not scorer.takes_tree_masks:
        log.info("attention cannot take packed rows; padding each sequence instead",
                 attention=scorer.attention)
        return LayoutOptions(options.micro_batch_tokens)
    return LayoutOptions(options.micro_batch_tokens, packing=options.packing, prefix_sharing=options.prefix_sharing)
