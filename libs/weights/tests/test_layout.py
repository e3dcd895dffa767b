"""The tensor-parallel layout: each rank's shards, loaded into a 1/tp-sized Qwen3 layer, compute
that rank's part of the full layer (partial sums of the row-parallel outputs add up to it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # the core imports without torch; its shard layouts need it
pytest.importorskip("transformers")

from transformers import Qwen3Config  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RotaryEmbedding  # noqa: E402

from plait_weights.layout import TensorParallelLayout  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB = 4, 2, 16, 64, 128, 101


def config(tp: int = 1, *, kv_per_rank: int | None = None) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN // tp,
        num_attention_heads=HEADS // tp,
        num_key_value_heads=kv_per_rank or KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        attn_implementation="eager",
    )


def rank_state(
    layout: TensorParallelLayout, module: torch.nn.Module, prefix: str
) -> list[dict[str, torch.Tensor]]:
    named = {f"{prefix}.{k}": v for k, v in module.state_dict().items()}
    return [
        {k.removeprefix(prefix + "."): v for k, v in shards.items()}
        for shards in layout.ranks(named)
    ]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_attention_and_mlp_shards_compute_each_ranks_part(tp):
    torch.manual_seed(0)
    layout = TensorParallelLayout(tp, HEAD_DIM)
    full_attention = Qwen3Attention(config(), layer_idx=0).eval()
    full_mlp = Qwen3MLP(config()).eval()
    x = torch.randn(2, 5, HIDDEN)
    rotary = Qwen3RotaryEmbedding(config())
    position_embeddings = rotary(x, torch.arange(5).unsqueeze(0))
    causal = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected_attention = full_attention(x, position_embeddings, causal)[0]
        expected_mlp = full_mlp(x)
        kv_per_rank = max(
            1, KV_HEADS // tp
        )  # with more ranks than KV heads, each rank holds one (replicated)
        attention_sum = torch.zeros_like(expected_attention)
        for shards in rank_state(layout, full_attention, "model.layers.0.self_attn"):
            part = Qwen3Attention(config(tp, kv_per_rank=kv_per_rank), layer_idx=0).eval()
            part.load_state_dict(shards)
            attention_sum += part(x, position_embeddings, causal)[0]
        mlp_sum = torch.zeros_like(expected_mlp)
        for shards in rank_state(layout, full_mlp, "model.layers.0.mlp"):
            part = Qwen3MLP(config(tp)).eval()
            part.load_state_dict(shards)
            mlp_sum += part(x)
    torch.testing.assert_close(attention_sum, expected_attention, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp_sum, expected_mlp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocabulary_rows_split_and_every_tensor_joins_back(tp):
    torch.manual_seed(1)
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
        "model.norm.weight": torch.randn(HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.down_proj.weight": torch.randn(HIDDEN, FFN),
    }
    if tp == 3:  # heads and FFN do not split in three: only the vocabulary and replicated tensors
        tensors = {k: v for k, v in tensors.items() if "embed" in k or "norm" in k}
    layout = TensorParallelLayout(tp, HEAD_DIM)
    ranks = layout.ranks(tensors)
    rows = [r["model.embed_tokens.weight"].shape[0] for r in ranks]
    assert sum(rows) == VOCAB and max(rows) - min(rows) <= tp
    ids = torch.randint(0, VOCAB, (7,))
    start = 0
    looked_up = torch.zeros(7, HIDDEN)
    for shard in (
        r["model.embed_tokens.weight"] for r in ranks
    ):  # vocab-parallel lookup: masked, summed
        local = ids - start
        inside = (local >= 0) & (local < shard.shape[0])
        looked_up += torch.where(inside[:, None], shard[local.clamp(0, shard.shape[0] - 1)], 0.0)
        start += shard.shape[0]
    torch.testing.assert_close(looked_up, tensors["model.embed_tokens.weight"][ids])
    for name, tensor in tensors.items():
        assert torch.equal(layout.join(name, [r[name] for r in ranks], tensor.shape), tensor), name


def test_shapes_that_do_not_split_are_named():
    layout = TensorParallelLayout(3, HEAD_DIM)
    with pytest.raises(ValueError, match=r"q_proj.*4 attention heads"):
        layout.split(
            "model.layers.0.self_attn.q_proj.weight", torch.zeros(HEADS * HEAD_DIM, HIDDEN)
        )
    with pytest.raises(ValueError, match="head_dim"):
        TensorParallelLayout(2, 24).split(
            "model.layers.0.self_attn.k_proj.weight", torch.zeros(32, HIDDEN)
        )
