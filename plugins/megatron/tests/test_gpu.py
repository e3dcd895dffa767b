"""Megatron's forward pass on converted weights gives Hugging Face's logits (needs CUDA:
megatron-core 0.16's RoPE and attention allocate on the current CUDA device)."""

from __future__ import annotations

import pytest
import torch

from plait_megatron.convert import Qwen3Shape, hf_to_megatron

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_logits_match_hugging_face(qwen3, tmp_path) -> None:
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from plait_megatron.model import build_gpt_model

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    try:
        try:
            import transformer_engine  # noqa: F401
            spec = "te"
        except ImportError:
            spec = "local"
        shape = Qwen3Shape.of(qwen3.config)
        hf = {k: v for k, v in qwen3.state_dict().items() if not (shape.tied_embeddings and k == "lm_head.weight")}
        gpt = build_gpt_model(qwen3.config, spec=spec).cuda().eval()
        gpt.load_state_dict(hf_to_megatron(hf, shape, spec), strict=False)
        ids = torch.randint(0, qwen3.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = qwen3.cuda()(ids.cuda()).logits.float()
            positions = torch.arange(24, device="cuda").expand(2, 24)
            causal = torch.triu(torch.ones(24, 24, dtype=torch.bool, device="cuda"), 1)[None, None]
            actual = gpt(ids.cuda(), positions, causal).float()
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
