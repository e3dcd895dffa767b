"""Grammar-constrained decoding libraries side by side: what plait-torch masks tool calls with.

For each of xgrammar, llguidance and outlines-core that imports here: its installed size (and
what it requires), the time to compile the tool-call grammar of two tools for SmolLM2's 49,152
token vocabulary, and the time to compute the next-token mask at every step of a valid call
(median and p90 over the steps of several passes; advancing the matcher is not counted).
The grammar is `plait_hf.grammar.tool_call_grammar` (GBNF, the dialect vLLM and SGLang take);
outlines-core compiles regular expressions only, so it gets the same call as a regex built from
the arguments' JSON schema.

    python benchmarks/grammar_masks.py [--passes 5]

Libraries that are not installed are reported as such; to compare without declaring them, put
them on PYTHONPATH (e.g. `pip install --no-deps --target /tmp/x xgrammar apache-tvm-ffi`).
Writes benchmarks/results/grammar_masks.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plait.api import ToolSpec
from plait_hf.grammar import tool_call_grammar

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [
    ToolSpec(
        "get_weather",
        "The weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
        },
    ),
    ToolSpec(
        "search",
        "Search the web.",
        {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    ),
]
CALL_TAIL = "}\n</tool_call>"
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Saint-Étienne du Rouvray", '
    '"days": 14, "unit": "celsius"}}\n</tool_call>'
)


def installed(dist: str) -> dict[str, Any]:
    """The installed size of `dist` in MB and what it requires (on this platform)."""
    meta = importlib.metadata.distribution(dist)
    size = sum((f.size or 0) for f in meta.files or ())
    requires = [r for r in meta.requires or () if "extra ==" not in r]
    return {"version": meta.version, "installed_mb": round(size / 1e6, 1), "requires": requires}


class Walk:
    """One library's matcher walked along the tokens of a valid call: `mask` computes the next
    mask and says whether a token is in it, `advance` takes the token, `reset` starts over."""

    def __init__(
        self,
        mask: Callable[[], Callable[[int], bool]],
        advance: Callable[[int], object],
        reset: Callable[[], object],
    ) -> None:
        self.mask, self.advance, self.reset = mask, advance, reset

    def mask_times(self, tokens: list[int], passes: int) -> list[float]:
        times = []
        for _ in range(passes):
            self.reset()
            for token in tokens:
                start = time.perf_counter()
                allowed = self.mask()
                times.append(time.perf_counter() - start)
                if not allowed(token):
                    raise AssertionError(f"token {token} of the valid call was masked out")
                self.advance(token)
        return times


def bit(bitmask: Any, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def bench_llguidance(tokenizer: Any, grammar: str, tokens: list[int], passes: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("ebnf", grammar))
    compile_s = time.perf_counter() - start
    bitmask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)

    def mask() -> Callable[[int], bool]:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        return lambda t: bit(bitmask, t)

    times = Walk(mask, matcher.consume_token, matcher.reset).mask_times(tokens, passes)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_s": times}


def bench_xgrammar(tokenizer: Any, grammar: str, tokens: list[int], passes: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar))
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def mask() -> Callable[[int], bool]:
        matcher.fill_next_token_bitmask(bitmask, 0)
        return lambda t: bit(bitmask, t)

    times = Walk(mask, matcher.accept_token, matcher.reset).mask_times(tokens, passes)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_s": times}


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Every token but the end-of-sequence one as the bytes it stands for (byte-level BPE)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    table: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != tokenizer.eos_token_id and all(c in byte_of for c in token):
            table.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
    return table


def bench_outlines_core(tokenizer: Any, tokens: list[int], passes: int) -> dict:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    vocabulary = Vocabulary(tokenizer.eos_token_id, token_bytes(tokenizer))
    tokenizer_s = time.perf_counter() - start
    calls = []
    for tool in TOOLS:
        arguments = build_regex_from_schema(json.dumps(tool.input_schema), r"[ ]?")
        head = re.escape(f'<tool_call>\n{{"name": "{tool.name}", "arguments": ')
        calls.append(f"{head}{arguments}{re.escape(CALL_TAIL)}")
    start = time.perf_counter()
    index = Index("(" + "|".join(calls) + ")", vocabulary)
    compile_s = time.perf_counter() - start
    state = [index.get_initial_state()]

    def mask() -> Callable[[int], bool]:
        allowed = np.zeros(len(tokenizer), dtype=bool)
        allowed[index.get_allowed_tokens(state[0])] = True
        return lambda t: bool(allowed[t])

    def advance(token: int) -> None:
        state[0] = index.get_next_state(state[0], token)

    def reset() -> None:
        state[0] = index.get_initial_state()

    times = Walk(mask, advance, reset).mask_times(tokens, passes)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from plait.components import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct").path))
    grammar = tool_call_grammar(TOOLS, "json")
    tokens = tokenizer.encode(CALL, add_special_tokens=False)
    runs: dict[str, Callable[[], dict]] = {
        "llguidance": lambda: bench_llguidance(tokenizer, grammar, tokens, args.passes),
        "xgrammar": lambda: bench_xgrammar(tokenizer, grammar, tokens, args.passes),
        "outlines-core": lambda: bench_outlines_core(tokenizer, tokens, args.passes),
    }
    results: dict[str, Any] = {}
    for name, run in runs.items():
        try:
            meta = installed(name)
        except importlib.metadata.PackageNotFoundError:
            results[name] = {"error": "not installed"}
            continue
        measured = run()
        times = sorted(measured.pop("mask_s"))
        results[name] = {
            **meta,
            **{k: round(v, 3) for k, v in measured.items()},
            "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_p90": round(times[int(0.9 * (len(times) - 1))] * 1e6, 1),
            "mask_us_max": round(times[-1] * 1e6, 1),
        }
        print(name, json.dumps(results[name]))
    out = ROOT / "benchmarks" / "results" / "grammar_masks.json"
    out.write_text(
        json.dumps(
            {
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "vocab_size": len(tokenizer),
                "call_tokens": len(tokens),
                "passes": args.passes,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
