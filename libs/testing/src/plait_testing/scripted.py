"""A small Qwen3 checkpoint whose greedy output is a given token script, for multi-turn tests.

A random tiny model never writes a tool call, so multi-turn rollouts cannot be tested with one.
`build_scripted_qwen3` rewrites the weights of a small Qwen3 checkpoint (e.g. plait-torch's
`tiny-qwen3`) so that, whatever the context, the token after `start` is `script[0]`, after
`script[0]` it is `script[1]`, and so on: attention and the first MLPs are switched off, and the
last MLP becomes a key-value memory from each token's embedding to its successor's. The result is
an ordinary checkpoint that real inference engines load and sample (greedy sampling follows the
script; the engine's logprobs are the model's own).

The script's tokens must be distinct (the next token depends on the current one only), and `start`
must not occur in it. `script_tokens` finds such a tokenization of a text; it need not be the
canonical one, which is useful: a rollout that re-tokenized sampled text would change the ids.

Needs torch and transformers (imported when called).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "generation_config.json",
)


def script_tokens(
    tokenizer: Any,
    text: str,
    avoid: Sequence[int] = (),
    split: Mapping[str, Sequence[str]] | None = None,
) -> list[int]:
    """A tokenization of `text` into distinct token ids, none of them in `avoid`: added tokens
    (`<|im_end|>`, `<tool_call>`, ...) as themselves, the text between them by greedy longest
    match over the vocabulary, taking an unused id. `split` forces pieces apart (e.g.
    {"calculator": ["calcul", "ator"]}) to make the result deliberately non-canonical."""
    added = {text_: int(i) for text_, i in tokenizer.get_added_vocab().items()}
    pieces: dict[str, list[int]] = {}
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        if "\ufffd" not in piece and piece not in added:
            pieces.setdefault(piece, []).append(token_id)
    used = set(avoid)
    ids: list[int] = []

    def take(candidates: Sequence[int], what: str) -> None:
        free = [i for i in candidates if i not in used]
        if not free:
            raise ValueError(f"no unused token for {what!r}; change the text")
        ids.append(free[0])
        used.add(free[0])

    def segment(plain: str) -> None:
        position = 0
        while position < len(plain):
            forced = next(
                (
                    parts[0]
                    for word, parts in (split or {}).items()
                    if plain.startswith(word, position)
                ),
                None,
            )
            lengths = (
                [len(forced)] if forced else list(range(min(16, len(plain) - position), 0, -1))
            )
            fits = [
                n
                for n in lengths
                if any(i not in used for i in pieces.get(plain[position : position + n], ()))
            ]
            length = fits[0] if fits else lengths[-1]
            take(
                pieces.get(plain[position : position + length], []), plain[position : position + 10]
            )
            position += length

    position = 0
    pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
    for match in pattern.finditer(text) if added else ():
        segment(text[position : match.start()])
        take([added[match.group()]], match.group())
        position = match.end()
    segment(text[position:])
    return ids


def build_scripted_qwen3(base: Path, dest: Path, start: int, script: Sequence[int]) -> None:
    """Write into `dest` a copy of the Qwen3 checkpoint `base` whose greedy continuation after
    token `start` is `script` (end it with the end-of-turn token so that generation stops)."""
    import torch
    from transformers import AutoModelForCausalLM

    chain = [start, *script]
    if len(set(chain)) != len(chain):
        raise ValueError("the script's tokens (and start) must be distinct")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    layers = model.model.layers
    memory = layers[-1].mlp
    if memory.gate_proj.out_features < len(script):
        raise ValueError(
            f"the script has {len(script)} steps; "
            f"the model's MLP holds {memory.gate_proj.out_features}"
        )
    embeddings = model.get_input_embeddings().weight
    assert isinstance(embeddings, torch.Tensor)  # an nn.Embedding's weight, typed as a module's
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for weight in (memory.gate_proj.weight, memory.up_proj.weight):
            weight.zero_()
        # With attention and the earlier MLPs off, the last MLP sees norm(embedding of the current
        # token); each of its units fires for one key token and writes its successor's embedding.
        keys = layers[-1].post_attention_layernorm(embeddings[chain[:-1]])
        for unit, (key, successor) in enumerate(zip(keys, chain[1:], strict=True)):
            memory.gate_proj.weight[unit] = 10.0 * key / key.dot(key)
            memory.up_proj.weight[unit] = key / key.dot(key)
            memory.down_proj.weight[:, unit] = embeddings[successor] * (
                40.0 / embeddings[successor].norm()
            )
        logits = model(torch.tensor([chain[:-1]])).logits[0]
    follows = logits.argmax(-1).tolist()
    if follows != chain[1:]:
        wrong = next(i for i, (a, b) in enumerate(zip(follows, chain[1:], strict=True)) if a != b)
        raise ValueError(
            f"the scripted model would write {follows[wrong]} instead of {chain[wrong + 1]} "
            f"at step {wrong}"
        )
    dest = Path(dest)
    model.save_pretrained(str(dest))
    for name in TOKENIZER_FILES:
        if (Path(base) / name).is_file() and not (dest / name).exists():
            shutil.copyfile(Path(base) / name, dest / name)


QWEN_GENERATION_END = 198
"""The last token of every Qwen generation prompt ("<|im_start|>assistant\\n"): a script's start."""


def scripted_qwen3(
    base: Path, dest: Path, text: str, split: Mapping[str, Sequence[str]] | None = None
) -> tuple[Any, list[int]]:
    """A copy of the Qwen3 checkpoint `base` in `dest` whose greedy reply to any chat prompt is
    `text` (`script_tokens` of it), as a `ResolvedModel` named after `dest`, and the script's
    ids."""
    from plait.api import ResolvedModel
    from plait_hf.chat_template import load_tokenizer

    ids = script_tokens(load_tokenizer(base), text, avoid=[QWEN_GENERATION_END], split=split)
    build_scripted_qwen3(base, dest, QWEN_GENERATION_END, ids)
    return ResolvedModel(dest.name, dest, dest), ids
