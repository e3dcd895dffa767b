"""LoRA: low-rank adapters on a frozen model's linear layers, saved and loaded in PEFT's layout.

    adapters = LoraAdapters.attach(model, LoraSpec(rank=8, alpha=16), seed=0)
    adapters.parameters_by_name()      # what trains: "base_model.model.<module>.lora_A.weight", ...
    adapters.merged_weights()          # the adapted modules' weights, W + alpha / rank * B @ A
    adapters.save(directory)           # adapter_config.json + adapter_model.safetensors (PEFT)

Each adapted `nn.Linear` keeps its own parameters (and names); a forward hook adds
`alpha / rank * B(A(x))` to its output, so activation checkpointing, packing and prefix sharing
see the same modules as without adapters. A starts Kaiming-uniform and B at zero (PEFT's
initialisation), so an attached adapter leaves the model's outputs as they were.

Which modules: the attention projections (q, k, v, o) and the MLP's (gate, up, down) of Llama /
Qwen / Mistral-style models, chosen by `LoraSpec.train_attn` / `train_mlp` (Tinker's
`lora_config`). Mixture-of-experts expert weights (fused 3-D tensors, not `nn.Linear`) are not
adapted; their attention is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from plait.errors import ConfigError, ModelError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@attrs.frozen
class LoraSpec:
    rank: int
    alpha: float
    train_attn: bool = True
    train_mlp: bool = True

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def target_names(self) -> tuple[str, ...]:
        return (ATTENTION_MODULES if self.train_attn else ()) + (MLP_MODULES if self.train_mlp else ())


class _Adapter(torch.nn.Module):
    """The low-rank branch of one linear layer (PEFT's names: lora_A, lora_B)."""

    def __init__(self, base: torch.nn.Linear, rank: int, scaling: float, generator: torch.Generator) -> None:
        super().__init__()
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False, **factory)
        bound = 1 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        with torch.no_grad():
            self.lora_A.weight.copy_(torch.rand(self.lora_A.weight.shape, generator=generator) * 2 * bound - bound)
            self.lora_B.weight.zero_()
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling

    def delta(self) -> torch.Tensor:
        """alpha / rank * B @ A: what the adapter adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


class LoraAdapters:
    """Adapters attached to a model's linear layers (see the module doc)."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec, adapters: Mapping[str, _Adapter]) -> None:
        self.model, self.spec = model, spec
        self.adapters = dict(adapters)  # module path -> adapter
        self.modules = torch.nn.ModuleDict({path.replace(".", "/"): a for path, a in self.adapters.items()})
        bases = dict(model.named_modules())
        self._hooks = [bases[path].register_forward_hook(_add_branch(adapter)) for path, adapter in self.adapters.items()]

    @classmethod
    def attach(cls, model: torch.nn.Module, spec: LoraSpec, seed: int = 0, *, key: str = "lora") -> LoraAdapters:
        """Adapters on `model`'s targeted layers, its own weights frozen; `key` is the config
        path that errors name."""
        if spec.rank < 1:
            raise ConfigError(f"{key}.rank", f"must be >= 1, got {spec.rank}")
        targets = spec.target_names()
        if not targets:
            raise ConfigError(key, "train_attn and train_mlp are both off: nothing to adapt",
                              fix="turn on train_attn or train_mlp")
        generator = torch.Generator().manual_seed(seed)
        found = {path: module for path, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in targets}
        if not found:
            raise ModelError(f"no linear layer named {', '.join(targets)} in {type(model).__name__}",
                             fix="LoRA here adapts Llama/Qwen/Mistral-style projections; use a model of that "
                                 "family, or train without lora")
        model.requires_grad_(False)
        return cls(model, spec, {path: _Adapter(module, spec.rank, spec.scaling, generator)
                                 for path, module in sorted(found.items())})

    def parameters_by_name(self) -> dict[str, torch.nn.Parameter]:
        """Every adapter weight by its PEFT name."""
        return {f"{PEFT_PREFIX}{path}.{part}.weight": getattr(adapter, part).weight
                for path, adapter in self.adapters.items() for part in ("lora_A", "lora_B")}

    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, base weight + delta) of every adapted module: new tensors."""
        bases = dict(self.model.named_modules())
        with torch.no_grad():
            for path, adapter in self.adapters.items():
                weight = bases[path].weight
                yield f"{path}.weight", weight + adapter.delta().to(weight.dtype)

    def save(self, directory: str | Path) -> None:
        """PEFT's layout: adapter_config.json and adapter_model.safetensors."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({name: p.detach().contiguous().cpu() for name, p in self.parameters_by_name().items()},
                  str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(peft_config(self.spec, self.model), indent=1))

    def load(self, directory: str | Path) -> None:
        """Copy a saved adapter of the same shape into these adapters."""
        tensors = read_adapter(directory)
        params = self.parameters_by_name()
        if set(tensors) != set(params):
            missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
            raise ModelError(f"adapter in {directory} does not match this model's adapters: "
                             f"missing {missing[:3]}, unexpected {extra[:3]}",
                             fix="load an adapter saved with the same rank and train_attn/train_mlp")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[name])

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _add_branch(adapter: _Adapter) -> Any:
    def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output + adapter(inputs[0]).to(output.dtype)

    return hook


def peft_config(spec: LoraSpec, model: torch.nn.Module) -> dict[str, Any]:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "target_modules": sorted(spec.target_names()), "bias": "none", "lora_dropout": 0.0,
            "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "base_model_name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None)}


def read_adapter(directory: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors by name; a clear error when `directory` holds none."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise ModelError(f"{directory} is not a LoRA adapter (no {CONFIG_FILE} and {WEIGHTS_FILE})",
                         fix="pass a directory saved by a LoRA trainer or by PEFT's save_pretrained")
    return load_file(str(directory / WEIGHTS_FILE))


def adapter_deltas(directory: str | Path) -> dict[str, torch.Tensor]:
    """What a PEFT adapter adds to each base weight, by the weight's Hugging Face name:
    lora_alpha / r * B @ A (float32)."""
    directory = Path(directory)
    tensors = read_adapter(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("use_dora") or config.get("use_rslora"):
        raise ModelError(f"adapter in {directory} uses DoRA or rsLoRA, which plait does not merge",
                         fix="save a plain LoRA adapter")
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
    """Add a PEFT adapter's deltas to `model`'s weights in place; returns how many weights changed."""
    params = dict(model.named_parameters())
    deltas = adapter_deltas(directory)
    unknown = sorted(set(deltas) - set(params))
    if unknown:
        raise ModelError(f"adapter in {directory} adapts weights this model does not have, e.g. {unknown[:3]}",
                         fix="use an adapter trained on this base model")
    with torch.no_grad():
        for name, delta in deltas.items():
            if tuple(delta.shape) != tuple(params[name].shape):
                raise ModelError(f"adapter in {directory}: {name} delta has shape {tuple(delta.shape)}, the "
                                 f"model's weight {tuple(params[name].shape)}",
                                 fix="use an adapter trained on this base model")
            params[name].add_(delta.to(device=params[name].device, dtype=params[name].dtype))
    return len(deltas)
