"""On a CUDA device, with megatron-core's own kernels (DotProductAttention with the local spec, or
Transformer Engine's layers and attention when TE is installed): Megatron's forward pass gives
Hugging Face's logits on converted weights, the engine matches plait-torch's logprobs, loss and
gradients, and the trainer contract kit passes. Marker gpu; skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.api import ResolvedModel
from plait_megatron.convert import Qwen3Shape, hf_to_megatron, megatron_to_hf
from plait_testing.trainer import (
    TrainerEngineContract,
    datum_logprobs,
    random_tokens,
    sft_datum,
    vocab_size,
)

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ON_CUDA = {
    "device": "cuda",
    "attention": "megatron",
}  # spec auto: te when Transformer Engine imports


def test_logits_match_hugging_face(qwen3, tmp_path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from plait_megatron.model import build_gpt_model

    dist.init_process_group(
        "nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    try:
        try:
            import transformer_engine  # noqa: F401

            spec = "te"
        except ImportError:
            spec = "local"
        shape = Qwen3Shape.of(qwen3.config)
        hf = {
            k: v
            for k, v in qwen3.state_dict().items()
            if not (shape.tied_embeddings and k == "lm_head.weight")
        }
        gpt = build_gpt_model(qwen3.config, spec=spec).cuda().eval()
        gpt.load_state_dict(hf_to_megatron(hf, shape, spec), strict=False)
        ids = torch.randint(
            0, qwen3.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
        )
        with torch.no_grad():
            expected = qwen3.cuda()(ids.cuda()).logits.float()
            positions = torch.arange(24, device="cuda").expand(2, 24)
            causal = torch.triu(torch.ones(24, 24, dtype=torch.bool, device="cuda"), 1)[None, None]
            actual = gpt(ids.cuda(), positions, causal).float()
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_engine_matches_plait_torch_on_cuda(tiny_model: ResolvedModel) -> None:
    from plait_megatron.engine import MegatronTrainer
    from plait_megatron.options import MegatronOptions
    from plait_torch.options import TorchTrainerOptions
    from plait_torch.trainer import TorchTrainer

    vocab = vocab_size(tiny_model)
    prompt = random_tokens(
        3, 8, vocab
    )  # shared by every datum: prefix sharing where the kernel allows
    data = [sft_datum(prompt + random_tokens(10 + i, 3 + 2 * i, vocab)) for i in range(4)]
    reference = TorchTrainer(
        tiny_model, options=TorchTrainerOptions(device="cuda", attn_implementation="sdpa")
    )
    megatron = MegatronTrainer(tiny_model, options=MegatronOptions(**ON_CUDA))
    try:
        assert megatron.scorer.gpt.decoder.layers[
            0
        ].self_attention.core_attention.__class__.__name__ in (
            "DotProductAttention",
            "TEDotProductAttention",
        )
        for lp_ref, lp_mg in zip(
            datum_logprobs(reference.forward(data)),
            datum_logprobs(megatron.forward(data)),
            strict=True,
        ):
            np.testing.assert_allclose(lp_mg, lp_ref, atol=1e-3)
        loss_ref = reference.forward_backward(data, "cross_entropy").metrics["loss:sum"]
        loss_mg = megatron.forward_backward(data, "cross_entropy").metrics["loss:sum"]
        assert loss_mg == pytest.approx(loss_ref, rel=1e-4)
        grads = megatron_to_hf(
            {n: p.grad for n, p in megatron.gpt.named_parameters()}, megatron.shape, megatron.spec
        )
        for name, param in reference.model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-2, atol=1e-4, msg=name)
    finally:
        reference.close()
        megatron.close()


class TestMegatronTrainerOnCuda(TrainerEngineContract):
    logprob_atol = 5e-4

    @pytest.fixture
    def make_trainer(self, model: ResolvedModel):
        from plait_megatron.engine import MegatronTrainer
        from plait_megatron.options import MegatronOptions

        options = MegatronOptions(**ON_CUDA, micro_batch_tokens=24)
        return lambda: MegatronTrainer(model, options=options, seed=0)

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model
