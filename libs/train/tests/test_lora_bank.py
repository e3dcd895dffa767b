"""plait_train.lora.LoraBank: adapters chosen per token in one pass give what each gives alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.api import LoraConfig, ModelError
from plait_train.lora import LoraBank, adapter_deltas


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def trained_bank(model: torch.nn.Module) -> LoraBank:
    """Adapters "a" (all layers) and "b" (attention only, another rank) with B made non-zero."""
    bank = LoraBank(model)
    bank.add("a", LoraConfig(rank=4, alpha=8), seed=1)
    bank.add("b", LoraConfig(rank=2, alpha=2, train_mlp=False), seed=2)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in ("a", "b"):
            for key, param in bank.parameters_of(name).items():
                if ".lora_B." in key:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return bank


def logits_with(
    bank: LoraBank, ids: torch.Tensor, route: list[int], names: list[str]
) -> torch.Tensor:
    adapter_of_token = torch.tensor(route)[:, None].expand_as(ids)
    with bank.routing(adapter_of_token, names):
        return bank.model(input_ids=ids).logits


def test_a_mixed_batch_equals_each_adapter_alone() -> None:
    model = tiny_llama()
    bank = trained_bank(model)
    ids = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(0))
    mixed = logits_with(bank, ids, [0, 1, -1], ["a", "b"])
    alone = [logits_with(bank, ids[i : i + 1], [0], [name]) for i, name in ((0, "a"), (1, "b"))]
    base = model(input_ids=ids[2:3]).logits  # no routing: the base model
    torch.testing.assert_close(mixed[0:1], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1:2], alone[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[2:3], base, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        alone[0], model(input_ids=ids[0:1]).logits
    )  # the adapter changes things


def test_gradients_of_a_mixed_batch_reach_each_adapter_as_alone() -> None:
    model = tiny_llama()
    bank = trained_bank(model)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))

    def grads(rows: slice, route: list[int], names: list[str]) -> dict[str, torch.Tensor]:
        for name in ("a", "b"):
            for param in bank.parameters_of(name).values():
                param.grad = None
        logits_with(bank, ids[rows], route, names).logsumexp(-1).sum().backward()
        return {
            f"{name}/{key}": p.grad.clone()
            for name in ("a", "b")
            for key, p in bank.parameters_of(name).items()
            if p.grad is not None
        }

    mixed = grads(slice(0, 2), [0, 1], ["a", "b"])
    alone = {**grads(slice(0, 1), [0], ["a"]), **grads(slice(1, 2), [0], ["b"])}
    assert mixed.keys() == alone.keys() and any(k.startswith("b/") for k in mixed)
    for key in mixed:
        torch.testing.assert_close(mixed[key], alone[key], atol=1e-5, rtol=1e-4, msg=key)
    assert all(p.grad is None for p in model.parameters()), "the base model is frozen"


def test_adapters_save_and_load_in_peft_layout(tmp_path: Path) -> None:
    bank = trained_bank(tiny_llama())
    bank.save("b", tmp_path / "b")
    merged = dict(bank.merged_weights("b"))
    deltas = adapter_deltas(tmp_path / "b")
    assert set(deltas) == set(merged) and all(".self_attn." in name for name in deltas)
    base = dict(bank.model.named_parameters())
    for name, delta in deltas.items():
        torch.testing.assert_close(base[name] + delta, merged[name])

    other = LoraBank(tiny_llama())
    other.add("copy", LoraConfig(rank=2, alpha=2, train_mlp=False))
    other.load("copy", tmp_path / "b")
    for (k1, p1), (k2, p2) in zip(
        bank.parameters_of("b").items(), other.parameters_of("copy").items(), strict=True
    ):
        assert k1 == k2 and torch.equal(p1, p2)
    other.add("wrong", LoraConfig(rank=4, alpha=2, train_mlp=False))
    with pytest.raises(ModelError, match="rank or adapted layers differ"):
        other.load("wrong", tmp_path / "b")


def test_routing_errors_are_clear() -> None:
    bank = trained_bank(tiny_llama())
    with (
        pytest.raises(KeyError, match="no adapter 'c'"),
        bank.routing(torch.zeros(1, 4, dtype=torch.long), ["c"]),
    ):
        pass
    with (
        pytest.raises(ValueError, match="routing covers 4 tokens"),
        bank.routing(torch.zeros(1, 4, dtype=torch.long), ["a"]),
    ):
        bank.model(input_ids=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="exists already"):
        bank.add("a", LoraConfig(rank=1, alpha=1))
    with pytest.raises(ValueError, match="adapts nothing"):
        bank.add("c", LoraConfig(rank=1, alpha=1, train_attn=False, train_mlp=False))


def test_the_default_adapter_applies_outside_routing() -> None:
    model = tiny_llama()
    bank = trained_bank(model)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    base = model(input_ids=ids).logits
    bank.default = "a"
    torch.testing.assert_close(model(input_ids=ids).logits, logits_with(bank, ids, [0, 0], ["a"]))
    with bank.routing(torch.full_like(ids, -1), ["a"]):  # routing says: the base
        torch.testing.assert_close(model(input_ids=ids).logits, base)
    bank.remove("a")
    assert bank.default is None
    torch.testing.assert_close(model(input_ids=ids).logits, base)


def test_adapters_in_no_order_are_gathered_and_scattered_back() -> None:
    """Rows of adapters a, b, a, the base, b: no adapter's tokens are one stretch, so the bank
    gathers them into adapter order and back; every row gets what it gets alone, forward and
    backward."""
    model = tiny_llama()
    bank = trained_bank(model)
    ids = torch.randint(0, 97, (5, 7), generator=torch.Generator().manual_seed(4))
    route = [0, 1, 0, -1, 1]
    with bank.routing(torch.tensor(route)[:, None].expand_as(ids), ["a", "b"]):
        assert bank._order is not None  # the gather path

    def run(rows: list[int], routes: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for name in ("a", "b"):
            for param in bank.parameters_of(name).values():
                param.grad = None
        logits = logits_with(bank, ids[rows], routes, ["a", "b"])
        if logits.requires_grad:  # not for the base's row alone
            logits.logsumexp(-1).sum().backward()
        grads = {
            f"{name}/{key}": p.grad.clone()
            for name in ("a", "b")
            for key, p in bank.parameters_of(name).items()
            if p.grad is not None
        }
        return logits.detach(), grads

    mixed, mixed_grads = run(list(range(5)), route)
    summed: dict[str, torch.Tensor] = {}
    for row, adapter in enumerate(route):
        alone, grads = run([row], [adapter])
        torch.testing.assert_close(mixed[row : row + 1], alone, atol=1e-5, rtol=1e-5)
        for key, grad in grads.items():
            summed[key] = summed.get(key, 0) + grad
    assert mixed_grads.keys() == summed.keys() and any(k.startswith("b/") for k in summed)
    for key, grad in summed.items():
        torch.testing.assert_close(mixed_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)
