"""A Megatron-core GPTModel built on CPU from a Hugging Face Qwen3 config takes the converted
weights strictly (same names and shapes) and gives them back exactly. Skips without
megatron-core."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait_megatron.convert import Qwen3Shape, hf_to_megatron, megatron_to_hf

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory):
    """One gloo process with tensor/pipeline parallel size 1, as megatron-core requires."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    store = dist.FileStore(str(Path(tmp_path_factory.mktemp("gloo")) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_gpt_model_takes_the_converted_weights(qwen3, model_parallel) -> None:
    from plait_megatron.model import build_gpt_model

    gpt = build_gpt_model(qwen3.config, spec="local", cpu=True)
    shape = Qwen3Shape.of(qwen3.config)
    hf = {
        k: v
        for k, v in qwen3.state_dict().items()
        if not (shape.tied_embeddings and k == "lm_head.weight")
    }
    converted = hf_to_megatron(hf, shape, "local")
    expected = {
        k: tuple(v.shape) for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")
    }
    assert {k: tuple(v.shape) for k, v in converted.items()} == expected
    result = gpt.load_state_dict(converted, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    back = megatron_to_hf(gpt.state_dict(), shape, "local")
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
