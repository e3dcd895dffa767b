"""The "torch" trainer engine: any Hugging Face causal LM, on the CPU or one CUDA device.

Data follow the Tinker surface: position i of a datum's `model_input` predicts
`loss_fn_inputs["target_tokens"][i]`. A call's data are laid out in micro-batches of at most
`options.micro_batch_tokens` tokens (`plait_train.layout`): packed into rows with their own
position ids and no attention across sequences, with the prefixes that datums share (a GRPO
group's prompt) computed once, or one right-padded row per datum when both are off. Every
token-sum loss sees only real positions. Gradients accumulate across `forward_backward` calls
until `optim_step`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from plait.api import (
    AdapterEngine,
    ConfigError,
    Datum,
    ForwardBackwardOutput,
    LoraConfig,
    ModelError,
    ResolvedModel,
    TrainerCapabilities,
)
from plait_torch.options import TorchTrainerOptions
from plait_train import loading
from plait_train.checkpointing import apply_activation_checkpointing
from plait_train.engine import SingleProcessEngine
from plait_train.layout import LayoutOptions
from plait_train.lora import LoraBank
from plait_train.perf import FlopsModel
from plait_train.routing import RoutingHooks, moe_shape
from plait_train.scorer import TokenScorer, ValueScorer
from plait_train.step import StepRunner, to_output

log = structlog.get_logger("plait_torch.trainer")

ADAPTER = "policy"  # the name of the trained adapter with trainer.options.lora
VALUE_HEAD_FILE = "value_head.safetensors"  # a value model's head, beside its weights


class TorchTrainer(SingleProcessEngine):
    """`plait.protocols.TrainerEngine` on PyTorch + transformers."""

    engine_name = "plait-torch"
    state_meta_file = "plait_trainer.json"

    def __init__(
        self, model: ResolvedModel, *, options: TorchTrainerOptions | None = None, seed: int = 0
    ) -> None:
        self.options = options or TorchTrainerOptions()
        self.model_info = model
        loading.set_threads(self.options.threads)
        torch.manual_seed(seed)
        device = loading.select_device(self.options.device)
        autocast_dtype, param_dtype = loading.training_dtypes(model, self.options.mixed_precision)
        self.tokenizer = loading.load_tokenizer(model.tokenizer_path)
        self.model = loading.load_causal_lm(
            model,
            dtype=param_dtype,
            device=device,
            attn_implementation=self.options.attn_implementation,
        )
        loading.check_tokenizer_fits(self.tokenizer, self.model, model)
        self.model.config.use_cache = False
        # The reference policy without LoRA: a frozen copy of the initial weights (taken before
        # any hook or adapter is attached; the model source, so a resumed trainer has it too).
        frozen = (
            copy.deepcopy(self.model).requires_grad_(False)
            if self.options.reference and self.options.lora is None
            else None
        )
        checkpointing = self.options.activation_checkpointing
        if checkpointing:
            apply_activation_checkpointing(
                self.model, "full" if checkpointing is True else checkpointing
            )
        self.model.train()
        self.lora: LoraBank | None = None
        if self.options.lora is not None:
            lora = self.options.lora
            self.lora = LoraBank(self.model)
            self.lora.add(ADAPTER, LoraConfig(**attrs.asdict(lora)), seed=seed)
            self.lora.default = ADAPTER
        self.vocab_rows = loading.embedding_rows(self.model)
        self.scorer = (
            ValueScorer(self.model) if self.options.value_head else TokenScorer(self.model)
        )
        if self.options.value_head:
            self.output_name = "values"
        elif self.lora:
            self.scorer.head_adapters = self.lora.unembedding_adapters
        layout = _layout(self.options, self.scorer)
        routing = RoutingHooks(self.model) if moe_shape(self.model) else None
        self.reference: TokenScorer | _BaseScorer | None = None
        """The reference policy with trainer.options.reference (`TorchTrainerOptions.reference`)."""
        if frozen is not None:
            self.reference = TokenScorer(frozen)
        elif self.options.reference and self.lora is not None:
            self.reference = _BaseScorer(self.lora, self.scorer)
        if self.options.routing_replay and routing is None:
            raise ConfigError(
                "trainer.options.routing_replay",
                f"model {model.name!r} is not a mixture of experts: it has no router to replay",
                fix="turn routing_replay off for dense models",
            )
        self.capabilities = TrainerCapabilities(
            packing=layout.packing,
            prefix_sharing=layout.prefix_sharing,
            activation_checkpointing=True,
            routing_replay=routing is not None,
            lora=self.lora is not None,
            value_head=self.options.value_head,
        )
        runner = StepRunner(
            self.scorer,
            layout=layout,
            device=device,
            flops=FlopsModel.of(self.model),
            vocab_rows=self.vocab_rows,
            autocast_dtype=autocast_dtype,
            routing=routing,
            routing_replay=self.options.routing_replay,
            reference=self.reference,
        )
        # Tied parameters appear once; with LoRA only the adapters train.
        trained = (
            self.lora.parameters_of(ADAPTER) if self.lora else dict(self.model.named_parameters())
        )
        if isinstance(self.scorer, ValueScorer):
            trained |= {f"value_head.{n}": p for n, p in self.scorer.value_head.named_parameters()}
        self._init_training(runner, trained)
        log.info(
            "trainer ready",
            model=model.name,
            device=str(self.device),
            dtype=str(param_dtype),
            params=sum(p.numel() for p in self._params.values()),
            packing=layout.packing,
            prefix_sharing=layout.prefix_sharing,
            activation_checkpointing=checkpointing,
            lora_rank=self.options.lora.rank if self.options.lora else None,
        )

    # -- protocol (forward, forward_backward, optim_step: SingleProcessEngine) ------------------

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor) for every parameter of the model (tied ones once, under
        their first name); with LoRA, the adapted weights merged (base + adapter, new tensors).

        The other tensors are the live parameters, detached: valid until the next `optim_step` or
        `load_state`; copy them to keep them longer.
        """
        yield from _merged(self.model, self.lora, ADAPTER)

    def _save_weights(self, directory: Path) -> None:
        if self.lora:
            self.lora.save(ADAPTER, directory)  # the adapter alone, in PEFT's layout
        else:
            self.model.save_pretrained(
                str(directory), safe_serialization=True
            )  # a Hugging Face checkpoint
        if isinstance(self.scorer, ValueScorer):
            from safetensors.torch import save_file

            head = {f"value_head.{n}": p for n, p in self.scorer.value_head.state_dict().items()}
            save_file(head, str(directory / VALUE_HEAD_FILE))

    def _load_weights(self, directory: Path) -> None:
        from safetensors.torch import load_file

        if isinstance(self.scorer, ValueScorer):
            head = load_file(str(directory / VALUE_HEAD_FILE))
            self.scorer.value_head.load_state_dict(
                {n.removeprefix("value_head."): t for n, t in head.items()}
            )
        if self.lora:
            self.lora.load(ADAPTER, directory)
            return
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            weights.update(load_file(str(file)))
        if set(self._params) - set(weights):
            # transformers saves some fused parameters in another layout (a mixture of experts'
            # 3-D expert weights as one tensor per expert); its loader converts them back.
            saved = loading.load_causal_lm(
                attrs.evolve(self.model_info, path=directory),
                dtype=torch.float32,
                device=torch.device("cpu"),
                attn_implementation=None,
            )
            weights = dict(saved.named_parameters()) | {
                name: t for name, t in weights.items() if name.startswith("value_head.")
            }
        missing = sorted(set(self._params) - set(weights))
        if missing:
            raise ModelError(
                f"trainer state {directory} lacks weights {missing[:5]}", fix="save the state again"
            )
        for name, param in self._params.items():
            param.copy_(weights[name])

    def open_adapter(self, name: str, lora: LoraConfig, seed: int = 0) -> LoraRun:
        """`plait.protocols.AdapterTrainer`: a LoRA adapter on this trainer's model, trained as an
        engine of its own. The model's weights freeze for good (train through the adapters)."""
        if self.lora is None:
            self.lora = LoraBank(self.model)
            self.scorer.head_adapters = self.lora.unembedding_adapters
            self._params.clear()  # the frozen base trains no more
        self.lora.add(name, lora, seed=seed)
        return LoraRun(self, name)

    def forward_backward_adapters(
        self,
        calls: Sequence[tuple[AdapterEngine, Sequence[Datum]]],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> list[ForwardBackwardOutput]:
        """Several adapters' forward_backward in the same passes (rows packed across adapters,
        each token through its own adapter: `StepRunner.run_groups`)."""
        names = [run.name for run, _ in calls if isinstance(run, LoraRun) and run.host is self]
        if len(names) != len(calls) or len(set(names)) < len(names):
            raise ValueError(
                "forward_backward_adapters takes distinct adapters opened on this trainer"
            )
        data = [datum for _, batch in calls for datum in batch]
        groups = [group for group, (_, batch) in enumerate(calls) for _ in batch]
        assert self.lora is not None
        results = self._runner.run_groups(
            data, groups, loss_fn, loss_fn_config, backward=True, router=self.lora, adapters=names
        )
        outputs, start = [], 0
        for (_, batch), result in zip(calls, results, strict=True):
            local = attrs.evolve(
                result, logprobs={i - start: v for i, v in result.logprobs.items()}
            )
            outputs.append(to_output(loss_fn, len(batch), [(range(len(batch)), local)]))
            start += len(batch)
        return outputs

    def close(self) -> None:
        self._close_training()
        self.model = None
        self.reference = self._runner.reference = None


class _BaseScorer:
    """A LoRA trainer's reference policy: its scorer with every adapter off (the base model)."""

    def __init__(self, bank: LoraBank, scorer: TokenScorer) -> None:
        self.bank, self.scorer = bank, scorer

    def __call__(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with self.bank.off():
            result: tuple[torch.Tensor, torch.Tensor] = self.scorer(*args)
        return result


class LoraRun(SingleProcessEngine):
    """One adapter of a `TorchTrainer` (`open_adapter`), a trainer engine of its own: its
    parameters, AdamW state, gradients, weight version and saved states (the adapter in PEFT's
    layout) are its own; the base model, the step runner and the device are the host's. Calls
    must not overlap with the host's or another adapter's (one worker thread runs them)."""

    engine_name = TorchTrainer.engine_name
    state_meta_file = TorchTrainer.state_meta_file

    def __init__(self, host: TorchTrainer, name: str) -> None:
        assert host.lora is not None
        self.host, self.name, self.bank = host, name, host.lora
        self.model_info = host.model_info
        self.capabilities = attrs.evolve(host.capabilities, lora=True)
        self._init_training(host._runner, self.bank.parameters_of(name))

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        outer, self.bank.default = self.bank.default, self.name
        try:
            yield
        finally:
            self.bank.default = outer

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        with self._active():
            return super().forward(data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        with self._active():
            return super().forward_backward(data, loss_fn, loss_fn_config)

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """The host model's weights with this adapter merged into the layers it adapts."""
        yield from _merged(self.host.model, self.bank, self.name)

    def _save_weights(self, directory: Path) -> None:
        self.bank.save(self.name, directory)

    def _load_weights(self, directory: Path) -> None:
        self.bank.load(self.name, directory)

    def close(self) -> None:
        if self.name in self.bank.adapters:
            self._close_training()
            self.bank.remove(self.name)


def _merged(
    model: torch.nn.Module, bank: LoraBank | None, adapter: str
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every parameter, tied ones once, with `adapter` merged where it adapts;
    a tied unembedding that the adapter changes comes as `lm_head.weight` of its own."""
    merged = dict(bank.merged_weights(adapter)) if bank else {}
    for name, param in model.named_parameters():
        yield name, merged.pop(name, param.detach())
    yield from merged.items()


def _layout(options: TorchTrainerOptions, scorer: TokenScorer) -> LayoutOptions:
    packed = options.packing or options.prefix_sharing
    if packed and not scorer.takes_tree_masks:
        log.info(
            "attention cannot take packed rows; padding each sequence instead",
            attention=scorer.attention,
        )
        return LayoutOptions(options.micro_batch_tokens)
    return LayoutOptions(
        options.micro_batch_tokens, packing=options.packing, prefix_sharing=options.prefix_sharing
    )
