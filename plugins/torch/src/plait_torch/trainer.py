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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch

from plait.errors import ModelError
from plait.models import ResolvedModel
from plait.training import loading
from plait.training.checkpointing import apply_activation_checkpointing
from plait.training.engine import SingleProcessEngine
from plait.training.layout import LayoutOptions
from plait.training.perf import FlopsModel
from plait.training.scorer import TokenScorer
from plait.training.state import check_same_parameters, write_dir_atomically
from plait.training.step import StepRunner
from plait.types import TrainerCapabilities
from plait_torch.options import TorchTrainerOptions

log = structlog.get_logger("plait_torch.trainer")

STATE_FORMAT = 1
_META_FILE = "plait_trainer.json"


class TorchTrainer(SingleProcessEngine):
    """`plait.protocols.TrainerEngine` on PyTorch + transformers."""

    def __init__(self, model: ResolvedModel, *, options: TorchTrainerOptions | None = None, seed: int = 0) -> None:
        self.options = options or TorchTrainerOptions()
        self.model_info = model
        loading.set_threads(self.options.threads)
        torch.manual_seed(seed)
        device = loading.select_device(self.options.device)
        dtype = loading.model_dtype(model)
        # bfloat16 models train with float32 master weights under autocast unless told otherwise.
        autocast_dtype = dtype if dtype != torch.float32 and self.options.mixed_precision else None
        param_dtype = torch.float32 if autocast_dtype is not None else dtype
        self.tokenizer = loading.load_tokenizer(model.tokenizer_path)
        self.model = loading.load_causal_lm(model, dtype=param_dtype, device=device,
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
        runner = StepRunner(self.scorer, layout=layout, device=device, flops=FlopsModel.of(self.model),
                            vocab_rows=self.vocab_rows, autocast_dtype=autocast_dtype)
        self._init_training(runner, dict(self.model.named_parameters()))  # tied parameters appear once
        log.info("trainer ready", model=model.name, device=str(self.device), dtype=str(param_dtype),
                 params=sum(p.numel() for p in self._params.values()), packing=layout.packing,
                 prefix_sharing=layout.prefix_sharing, activation_checkpointing=checkpointing)

    # -- protocol (forward, forward_backward, optim_step: SingleProcessEngine) ------------------

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

        def write(tmp: Path) -> None:
            self.model.save_pretrained(str(tmp), safe_serialization=True)
            self.save_training_state(tmp)
            (tmp / _META_FILE).write_text(json.dumps({
                "format": STATE_FORMAT, "weight_version": self._weight_version, "model": self.model_info.name,
                "parameters": self.parameter_shapes(), "saved_at": time.time(),
            }, indent=1))

        write_dir_atomically(path, write)
        log.info("trainer state saved", path=str(path), weight_version=self._weight_version)

    def load_state(self, path: str | Path) -> None:
        path = Path(path)
        meta_path = path / _META_FILE
        if not meta_path.is_file():
            raise ModelError(f"{path} is not a plait-torch trainer state (no {_META_FILE})",
                             fix="pass a directory written by save_state")
        meta = json.loads(meta_path.read_text())
        check_same_parameters(meta["parameters"], self.parameter_shapes(), path)
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
        self.load_training_state(path, meta["weight_version"])
        log.info("trainer state loaded", path=str(path), weight_version=self._weight_version)

    def close(self) -> None:
        self._close_training()
        self.model = None


def _layout(options: TorchTrainerOptions, scorer: TokenScorer) -> LayoutOptions:
    packed = options.packing or options.prefix_sharing
    if packed and not scorer.takes_tree_masks:
        log.info("attention cannot take packed rows; padding each sequence instead",
                 attention=scorer.attention)
        return LayoutOptions(options.micro_batch_tokens)
    return LayoutOptions(options.micro_batch_tokens, packing=options.packing, prefix_sharing=options.prefix_sharing)
