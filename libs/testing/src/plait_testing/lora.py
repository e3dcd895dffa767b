"""LoRA adapters for tests: a random PEFT-format adapter, and the logprobs it should give.

    # writes dest/adapter_config.json and dest/adapter_model.safetensors
    deltas = write_random_lora(model, dest)
    expected = merged_logprob(model, deltas, tokens)

Imports torch, safetensors and transformers on use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.api import ResolvedModel


def write_random_lora(
    model: ResolvedModel,
    dest: str | Path,
    rank: int = 4,
    alpha: int = 16,
    scale: float = 0.3,
    seed: int = 0,
) -> dict[str, Any]:
    """A PEFT adapter on q_proj and v_proj of every layer of a Llama/Qwen-style model, written to
    `dest`; returns the weight deltas (alpha / rank * B @ A) by the base weight's name."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model.path) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    deltas: dict[str, Any] = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=generator) * scale
            b = torch.randn(out, rank, generator=generator) * scale
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
            deltas[f"model.layers.{layer}.self_attn.{module}.weight"] = (alpha / rank) * b @ a
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": alpha,
                "target_modules": sorted(outs),
                "base_model_name_or_path": str(model.path),
                "bias": "none",
                "lora_dropout": 0.0,
                "fan_in_fan_out": False,
                "modules_to_save": None,
            }
        )
    )
    return deltas


def merged_logprob(model: ResolvedModel, deltas: Mapping[str, Any], tokens: Sequence[int]) -> float:
    """log p(tokens[-1] | tokens[:-1]) under the model with `deltas` added to its weights."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, delta in deltas.items():
            params[name].add_(delta)
        logits = hf(torch.tensor([list(tokens[:-1])])).logits[0, -1]
    return float(torch.log_softmax(logits, -1)[tokens[-1]])
