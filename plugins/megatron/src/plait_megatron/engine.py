"""The "megatron" trainer engine: a megatron-core GPTModel for Qwen3 checkpoints, in one process
(tensor and pipeline parallel size 1) on the CPU or one CUDA device.

The Hugging Face checkpoint is converted to Megatron's layout on load (`plait_megatron.convert`)
and back for `export_weights` and `save_state`, so what leaves the engine has Hugging Face names
(a saved state's weights are a loadable Hugging Face checkpoint). Data, micro-batches, layouts
(packing, prefix sharing) and losses are `plait_train.step.StepRunner`'s, exactly as in the
torch trainer; `plait_megatron.scorer.MegatronScorer` runs megatron-core's embedding and
transformer block in place of the Hugging Face model. The optimizer is torch's AdamW over the
GPTModel's parameters (`plait_train.optimizer`): megatron-core's own optimizer and DDP grad
buffers allocate on CUDA and add nothing at one process and TP = 1.

What differs between the CPU and CUDA is the attention kernel only (`MegatronOptions.attention`):
megatron-core's DotProductAttention / TEDotProductAttention on CUDA, plait's SDPACoreAttention
(same constructor and forward) on the CPU.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from plait.api import ConfigError, ModelError, PluginError, ResolvedModel, TrainerCapabilities
from plait_megatron import parallel
from plait_megatron.convert import Qwen3Shape, Spec, hf_to_megatron, megatron_to_hf
from plait_megatron.options import MegatronOptions
from plait_train import loading
from plait_train.engine import SingleProcessEngine
from plait_train.layout import LayoutOptions
from plait_train.perf import FlopsModel
from plait_train.step import StepRunner

log = structlog.get_logger("plait_megatron.engine")

_WEIGHTS_FILE = "model.safetensors"


class MegatronTrainer(SingleProcessEngine):
    """`plait.protocols.TrainerEngine` on megatron-core."""

    engine_name = "plait-megatron"
    state_meta_file = "plait_megatron.json"

    def __init__(
        self, model: ResolvedModel, *, options: MegatronOptions | None = None, seed: int = 0
    ) -> None:
        _require_megatron_core()
        self.options = options or MegatronOptions()
        self.model_info = model
        loading.set_threads(self.options.threads)
        torch.manual_seed(seed)
        self.device = loading.select_device(self.options.device)
        self.spec, attention = _kernels(self.options, self.device)
        autocast_dtype, param_dtype = loading.training_dtypes(model, self.options.mixed_precision)
        # The Hugging Face model is read once, for its weights, config, vocabulary and FLOPs.
        hf_model = loading.load_causal_lm(
            model, dtype=param_dtype, device=torch.device("cpu"), attn_implementation=None
        )
        loading.check_tokenizer_fits(loading.load_tokenizer(model.tokenizer_path), hf_model, model)
        self.hf_config = hf_model.config
        self.shape = Qwen3Shape.of(self.hf_config)
        self.vocab_rows = loading.embedding_rows(hf_model)
        flops = FlopsModel.of(hf_model)
        hf_state = _hf_weights(hf_model, self.shape)
        del hf_model

        parallel.acquire(self.device)
        self._closed = False
        try:
            self.gpt = self._build(hf_state, param_dtype, attention, seed)
        except BaseException:
            parallel.release()
            raise
        from plait_megatron.scorer import MegatronScorer

        self.scorer = MegatronScorer(
            self.gpt, takes_tree_masks=self.spec != "te" or attention is not None
        )
        layout = _layout(self.options, self.scorer.takes_tree_masks)
        self.capabilities = TrainerCapabilities(
            packing=layout.packing, prefix_sharing=layout.prefix_sharing
        )
        runner = StepRunner(
            self.scorer,
            layout=layout,
            device=self.device,
            flops=flops,
            vocab_rows=self.vocab_rows,
            autocast_dtype=autocast_dtype,
        )
        # Megatron names; tied ones once
        self._init_training(runner, dict(self.gpt.named_parameters()))
        log.info(
            "trainer ready",
            model=model.name,
            device=str(self.device),
            dtype=str(param_dtype),
            spec=self.spec,
            attention=attention.__name__ if attention else "megatron",
            params=sum(p.numel() for p in self._params.values()),
            packing=layout.packing,
            prefix_sharing=layout.prefix_sharing,
        )

    def _build(
        self,
        hf_state: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        attention: type | None,
        seed: int,
    ) -> Any:
        from plait_megatron.model import build_gpt_model

        cpu = self.device.type == "cpu"
        if not cpu:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            # the CUDA RNG states megatron-core's kernels fork
            model_parallel_cuda_manual_seed(seed)
        gpt = build_gpt_model(
            self.hf_config,
            spec=self.spec,
            params_dtype=dtype,
            cpu=cpu,
            core_attention=attention,
            initialize=False,
        )
        result = gpt.load_state_dict(hf_to_megatron(hf_state, self.shape, self.spec), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise ModelError(
                "the converted weights do not fit megatron-core's GPTModel: "
                f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}",
                fix="report it: plait_megatron.convert and the layer spec disagree",
            )
        return gpt.to(self.device).train()

    # -- protocol (forward, forward_backward, optim_step: SingleProcessEngine) ------------------

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor) of every weight, converted from the live parameters: those
        that map one to one and gate/up are views of them, valid until the next `optim_step` or
        `load_state` (copy them to keep them longer); q/k/v are copies, split out of Megatron's
        group-interleaved `linear_qkv`."""
        live = {name: param.detach() for name, param in self._params.items()}
        yield from megatron_to_hf(live, self.shape, self.spec).items()

    def _save_weights(self, directory: Path) -> None:
        """A Hugging Face checkpoint: safetensors in Hugging Face names and the model's config.json
        (so a saved state loads into any layer spec, and into transformers)."""
        from safetensors.torch import save_file

        weights = {name: tensor.contiguous().cpu() for name, tensor in self.export_weights()}
        save_file(weights, str(directory / _WEIGHTS_FILE), metadata={"format": "pt"})
        shutil.copy(Path(self.model_info.path) / "config.json", directory / "config.json")

    def _load_weights(self, directory: Path) -> None:
        from safetensors.torch import load_file

        megatron = hf_to_megatron(load_file(str(directory / _WEIGHTS_FILE)), self.shape, self.spec)
        for name, param in self._params.items():
            param.copy_(megatron[name])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_training()
        del self.gpt, self.scorer, self._runner  # their memory is freed now, not with the engine
        parallel.release()


def _hf_weights(hf_model: Any, shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    state = dict(hf_model.state_dict())
    if shape.tied_embeddings:
        state.pop("lm_head.weight", None)  # the embedding itself
    return state


def _kernels(options: MegatronOptions, device: torch.device) -> tuple[Spec, type | None]:
    """The layer spec and the core-attention module to put in it (None = the spec's own)."""
    cuda = device.type == "cuda"
    spec = options.spec
    if spec == "auto":
        spec = "te" if cuda and _has_transformer_engine() else "local"
    if not cuda and (spec == "te" or options.attention == "megatron"):
        raise ConfigError(
            "trainer.options",
            f"spec {options.spec!r} / attention {options.attention!r} need CUDA: "
            "megatron-core 0.16's DotProductAttention takes its buffers and RNG states from the "
            "CUDA device, and Transformer Engine is CUDA-only",
            fix="on the CPU use trainer.options.spec = 'local' and attention = 'sdpa' "
            "(the defaults there)",
        )
    if options.attention == "megatron" or (options.attention == "auto" and cuda):
        return spec, None
    from plait_megatron.attention import SDPACoreAttention

    return spec, SDPACoreAttention


def _require_megatron_core() -> None:
    """megatron-core is plait-megatron's optional extra `megatron`: say so before anything loads."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise PluginError(
            f"trainer.engine = 'megatron' needs megatron-core, which does not import: {exc}",
            fix="pip install 'plait-megatron[megatron]' (or pip install --no-deps "
            "megatron-core==0.16.1, which keeps the torch build you have)",
        ) from None


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _layout(options: MegatronOptions, takes_tree_masks: bool) -> LayoutOptions:
    packed = options.packing or options.prefix_sharing
    if packed and not takes_tree_masks:
        log.info(
            "Transformer Engine's causal attention ignores masks; padding each sequence instead"
        )
        return LayoutOptions(options.micro_batch_tokens)
    return LayoutOptions(
        options.micro_batch_tokens, packing=options.packing, prefix_sharing=options.prefix_sharing
    )
