"""LoRA: low-rank adapters on a frozen model's linear layers, one or many, in PEFT's layout.

    bank = LoraBank(model)                 # the model's own weights freeze
    bank.add("alice", LoraConfig(rank=8, alpha=16), seed=1)
    bank.add("bob", LoraConfig(rank=4, alpha=8, train_mlp=False), seed=2)
    with bank.routing(adapter_of_token, ["alice", "bob"]):  # (batch, seq) indices; -1 = the base
        loss = ...model(input_ids)...; loss.backward()  # grads reach each adapter's own weights
    bank.default = "alice"                 # outside `routing`: every token through alice
    bank.parameters_of("alice")            # "base_model.model.<module>.lora_A.weight", ...
    bank.merged_weights("alice")           # the adapted layers' W + alpha / rank * B @ A
    bank.save("alice", directory)          # adapter_config.json + adapter_model.safetensors

A forward hook on each adaptable `nn.Linear` adds the adapters' `alpha / rank * B(A(x))` to its
output, so the model keeps its modules and parameter names, and packing, prefix sharing and
activation checkpointing see it unchanged. A starts Kaiming-uniform and B at zero (PEFT's
initialisation): a new adapter leaves the model's outputs as they were.

Many adapters in one pass is the idea of Punica's segmented gather matmul (SGMV), in torch for any
device: the tokens are grouped by adapter once per `routing` (not per layer), and at every layer
each group runs its own adapter, added at the group's positions. When each adapter's tokens are
one stretch of the input already (`StepRunner.run_groups` lays shared passes out so where the
packing allows), the groups are slices of it; otherwise every layer gathers its input into
adapter order and its deltas back. One adapter adds its up-projection inside the matmul
(`addmm`), and the scaling applies on the rank-wide side. Each adapter's weights are its
own parameters, so each keeps its own optimizer state and gradients, and a step of one leaves the
others alone; adapters may differ in rank and in which layers they adapt. Two things a caller of
`routing` arranges: with activation checkpointing the backward pass recomputes the forward, so the
routing stays set until the backward is done; and positions computed once for several sequences
(prefix sharing) belong to sequences of one adapter.

Which layers: the attention projections (q, k, v, o) and the MLP's (gate, up, down) of Llama /
Qwen / Mistral-style models, and the unembedding (`lm_head`), chosen by `LoraConfig.train_attn` /
`train_mlp` / `train_unembed` (Tinker's `lora_config`). With tied embeddings the unembedding's
adapter changes the output projection only; merging it gives `lm_head` a weight of its own. The
chunked output head applies unembedding adapters itself (`unembedding_adapters`).
Mixture-of-experts expert weights (fused 3-D tensors, not `nn.Linear`) are not adapted; their
attention is.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from plait.api import LoraConfig, ModelError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def target_names(spec: LoraConfig) -> tuple[str, ...]:
    """The names of the linear layers an adapter with `spec` adapts."""
    return (
        (ATTENTION_MODULES if spec.train_attn else ())
        + (MLP_MODULES if spec.train_mlp else ())
        + (UNEMBED_MODULES if spec.train_unembed else ())
    )


class Adapter(torch.nn.Module):
    """The low-rank branch of one linear layer (PEFT's names: lora_A, lora_B)."""

    def __init__(
        self, base: torch.nn.Linear, rank: int, scaling: float, generator: torch.Generator
    ) -> None:
        super().__init__()
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False, **factory)
        bound = 1 / math.sqrt(
            base.in_features
        )  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        with torch.no_grad():
            self.lora_A.weight.copy_(
                torch.rand(self.lora_A.weight.shape, generator=generator) * 2 * bound - bound
            )
            self.lora_B.weight.zero_()
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.down(x))

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """alpha / rank * A x: the scaling is applied to the rank-wide side, which is cheaper."""
        return self.lora_A(x.to(self.lora_A.weight.dtype)) * self.scaling

    def add_to(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """output + alpha / rank * B A x, the addition inside the up-projection's matmul (one
        pass over the output instead of three: the product, its scaling and the sum)."""
        flat = output.reshape(-1, output.shape[-1])
        down = self.down(x.reshape(-1, x.shape[-1]))
        if flat.dtype != down.dtype and not torch.is_autocast_enabled(flat.device.type):
            return output + self.lora_B(down).to(output.dtype)
        return torch.addmm(flat, down, self.lora_B.weight.t()).view_as(output)

    def delta(self) -> torch.Tensor:
        """alpha / rank * B @ A: what the adapter adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


class LoraBank:
    """Adapters by name on one frozen model (see the module doc)."""

    default: str | None = None
    """The adapter every token goes through outside `routing` (None: the base model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        model.requires_grad_(False)
        targets = ATTENTION_MODULES + MLP_MODULES + UNEMBED_MODULES
        self.layers = {
            path: module
            for path, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in targets
        }
        if not self.layers:
            raise ModelError(
                f"no linear layer named {', '.join(targets)} in {type(model).__name__}",
                fix="LoRA here adapts Llama/Qwen/Mistral-style projections",
            )
        self.adapters: dict[str, dict[str, Adapter]] = {}
        self.specs: dict[str, LoraConfig] = {}
        # Within `routing`: the adapter index of every token; the permutation that puts the
        # tokens in adapter order and its inverse (None when they are in that order already);
        # each adapter's segment of them in that order (None: the tokens of the base alone).
        self._adapter_of: torch.Tensor | None = None
        self._order: tuple[torch.Tensor, torch.Tensor] | None = None
        self._segments: list[tuple[str | None, int]] = []
        self._names: list[str] = []
        self._tokens = 0
        self._unembedding = next(
            (path for path in self.layers if path.rsplit(".", 1)[-1] in UNEMBED_MODULES), None
        )
        self._hooks = [
            module.register_forward_hook(self._hook(path)) for path, module in self.layers.items()
        ]

    def add(self, name: str, spec: LoraConfig, seed: int = 0) -> dict[str, torch.nn.Parameter]:
        """A new adapter (B = 0: it starts as the base model); returns its parameters by PEFT
        name."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists already")
        wanted = target_names(spec)
        if spec.rank < 1 or not wanted:
            raise ValueError(
                f"adapter {name!r} adapts nothing: rank {spec.rank}, train_attn {spec.train_attn}, "
                f"train_mlp {spec.train_mlp}, train_unembed {spec.train_unembed}"
            )
        generator = torch.Generator().manual_seed(seed)
        self.adapters[name] = {
            path: Adapter(module, spec.rank, spec.alpha / spec.rank, generator)
            for path, module in sorted(self.layers.items())
            if path.rsplit(".", 1)[-1] in wanted
        }
        self.specs[name] = spec
        return self.parameters_of(name)

    def remove(self, name: str) -> None:
        self._check(name)
        del self.adapters[name], self.specs[name]
        if self.default == name:
            self.default = None

    def parameters_of(self, name: str) -> dict[str, torch.nn.Parameter]:
        self._check(name)
        return {
            f"{PEFT_PREFIX}{path}.{part}.weight": getattr(adapter, part).weight
            for path, adapter in self.adapters[name].items()
            for part in ("lora_A", "lora_B")
        }

    def merged_weights(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, base weight + delta) of every layer adapter `name` adapts."""
        self._check(name)
        with torch.no_grad():
            for path, adapter in self.adapters[name].items():
                weight = self.layers[path].weight
                yield f"{path}.weight", weight + adapter.delta().to(weight.dtype)

    def save(self, name: str, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {key: p.detach().contiguous().cpu() for key, p in self.parameters_of(name).items()},
            str(directory / WEIGHTS_FILE),
        )
        (directory / CONFIG_FILE).write_text(
            json.dumps(peft_config(self.specs[name], self.model), indent=1)
        )

    def load(self, name: str, directory: str | Path) -> None:
        tensors, params = read_adapter(directory), self.parameters_of(name)
        if set(tensors) != set(params) or any(
            tensors[k].shape != p.shape for k, p in params.items()
        ):
            raise ModelError(
                f"adapter in {directory} does not fit adapter {name!r} "
                "(rank or adapted layers differ)",
                fix="load it into an adapter made with the same rank, train_attn, train_mlp "
                "and train_unembed",
            )
        with torch.no_grad():
            for key, param in params.items():
                param.copy_(tensors[key])

    def unembedding_adapters(
        self, select: torch.Tensor
    ) -> list[tuple[torch.Tensor | None, Adapter | None]]:
        """For the flat positions `select` (into the model's input): groups of them (indices
        into `select`, None for all) and the adapter of the unembedding each group goes through
        (None: the base's). The chunked output head (`plait_train.scorer`) applies these itself,
        as it never calls the output projection's forward (where the hook would)."""
        head = self._unembedding
        if self._adapter_of is None or head is None:
            return [
                (None, self.adapters[self.default].get(head) if self.default and head else None)
            ]
        assert self._adapter_of is not None
        chosen = self._adapter_of[select]
        parts: list[tuple[torch.Tensor | None, Adapter | None]] = []
        for k, name in [(-1, None), *enumerate(self._names)]:
            rows = (chosen == k).nonzero().squeeze(-1)
            if rows.numel():
                parts.append((rows, self.adapters[name].get(head) if name else None))
        return parts

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Within the block, the base model alone: no adapter, default or routed (the reference
        policy of a LoRA trainer: the base is the initial policy)."""
        default, routed = self.default, self._adapter_of
        self.default = self._adapter_of = None
        try:
            yield
        finally:
            self.default, self._adapter_of = default, routed

    @contextlib.contextmanager
    def routing(self, adapter_of_token: torch.Tensor, names: Sequence[str]) -> Iterator[None]:
        """Within the block, the token at each position of the model's input goes through adapter
        `names[adapter_of_token[position]]` (-1: the base alone). `adapter_of_token` is shaped
        like the input ids."""
        for name in names:
            self._check(name)
        flat = adapter_of_token.reshape(-1)
        key = torch.where(flat < 0, len(names), flat)  # the base's tokens (-1) as adapter G
        starts = [0, *((key[1:] != key[:-1]).nonzero().squeeze(-1) + 1).tolist()]
        runs = key[starts].tolist() if len(flat) else []
        which = [*names, None]
        if len(set(runs)) == len(runs):  # each adapter's tokens one stretch already
            ends = [*starts[1:], len(flat)]
            self._segments = [(which[k], e - s) for k, s, e in zip(runs, starts, ends, strict=True)]
        else:  # a permutation puts them in adapter order
            order = torch.sort(key, stable=True).indices
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order), device=order.device)
            self._order = (order, inverse)
            counts = torch.bincount(key, minlength=len(which)).tolist()
            self._segments = [(n, c) for n, c in zip(which, counts, strict=True) if c]
        self._tokens = flat.numel()
        self._adapter_of, self._names = flat, list(names)
        try:
            yield
        finally:
            self._adapter_of = self._order = None

    def _hook(self, path: str) -> Any:
        def hook(
            _module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor:
            if self._adapter_of is None:  # outside `routing`: the default adapter, if any
                adapter = self.adapters[self.default].get(path) if self.default else None
                return output if adapter is None else adapter.add_to(output, inputs[0])
            adapters = [
                self.adapters[name].get(path) if name is not None else None
                for name, _ in self._segments
            ]
            if not any(adapters):  # no routed adapter adapts this layer
                return output
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            if x.shape[0] != self._tokens:
                raise ValueError(
                    f"the routing covers {self._tokens} tokens, layer {path} got {x.shape[0]}"
                )
            if len(adapters) == 1:  # one adapter for every token
                assert adapters[0] is not None
                return adapters[0].add_to(output, inputs[0])
            # The tokens in adapter order (a gather, unless they are in that order already),
            # each adapter on its contiguous segment, the deltas back in token order (the
            # segmented LoRA matmul of Punica's SGMV, in plain torch).
            flat = output.reshape(-1, output.shape[-1])
            if self._order is not None:
                x = _Rows.apply(x, *self._order)
            sizes = [count for _, count in self._segments]
            deltas = torch.cat(
                [
                    flat.new_zeros(len(part), flat.shape[-1])
                    if adapter is None
                    else adapter(part).to(flat.dtype)
                    for adapter, part in zip(adapters, x.split(sizes), strict=True)
                ]
            )
            if self._order is not None:
                deltas = _Rows.apply(deltas, *reversed(self._order))
            return (flat + deltas).view_as(output)

        return hook

    def _check(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no adapter {name!r}; adapters: {sorted(self.adapters)}")


class _Rows(torch.autograd.Function):
    """`x[order]` for a permutation `order` of x's rows (with `inverse` its inverse), whose
    gradient is gathered back (`grad[inverse]`) instead of scattered: on a CPU a scatter-add of
    rows takes several times as long as a gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> Any:
        ctx.inverse = inverse
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.index_select(0, ctx.inverse), None, None


def peft_config(spec: LoraConfig, model: torch.nn.Module) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(target_names(spec)),
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None),
    }


def read_adapter(directory: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors by name; a clear error when `directory` holds none."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise ModelError(
            f"{directory} is not a LoRA adapter (no {CONFIG_FILE} and {WEIGHTS_FILE})",
            fix="pass a directory saved by a LoRA trainer or by PEFT's save_pretrained",
        )
    return load_file(str(directory / WEIGHTS_FILE))


def adapter_deltas(directory: str | Path) -> dict[str, torch.Tensor]:
    """What a PEFT adapter adds to each base weight, by the weight's Hugging Face name:
    lora_alpha / r * B @ A (float32)."""
    directory = Path(directory)
    tensors = read_adapter(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("use_dora") or config.get("use_rslora"):
        raise ModelError(
            f"adapter in {directory} uses DoRA or rsLoRA, which plait does not merge",
            fix="save a plain LoRA adapter",
        )
    scaling = float(config["lora_alpha"]) / int(config["r"])
    deltas = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        deltas[f"{module}.weight"] = (b.float() @ a.float()) * scaling
    return deltas


def merge_adapter(model: torch.nn.Module, directory: str | Path) -> int:
    """Add a PEFT adapter's deltas to `model`'s weights in place; returns how many weights
    changed."""
    params = dict(model.named_parameters())
    deltas = adapter_deltas(directory)
    # A transformers model's method, looked up by getattr: torch types a module's unknown
    # attributes as tensors or submodules.
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    head_name = next(
        (f"{path}.weight" for path, module in model.named_modules() if module is head), None
    )
    if head_name in deltas and head_name not in params and head is not None:
        head.weight = torch.nn.Parameter(
            head.weight.detach().clone()
        )  # untie before adapting the head alone
        params[head_name] = head.weight
    unknown = sorted(set(deltas) - set(params))
    if unknown:
        raise ModelError(
            f"adapter in {directory} adapts weights this model does not have, e.g. {unknown[:3]}",
            fix="use an adapter trained on this base model",
        )
    with torch.no_grad():
        for name, delta in deltas.items():
            if tuple(delta.shape) != tuple(params[name].shape):
                raise ModelError(
                    f"adapter in {directory}: {name} delta has shape {tuple(delta.shape)}, the "
                    f"model's weight {tuple(params[name].shape)}",
                    fix="use an adapter trained on this base model",
                )
            params[name].add_(delta.to(device=params[name].device, dtype=params[name].dtype))
    return len(deltas)
