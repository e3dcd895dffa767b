"""Masking a sampler's next-token choice with a grammar (`SamplingParams.grammar`), with
llguidance: plait-torch's engine and the fake SGLang server sample through it.

Why llguidance: it reads the GBNF that vLLM and SGLang take, installs as one 8 MB wheel without
dependencies, and computes a mask over SmolLM2's 49k-token vocabulary in about 20 us (xgrammar
needs triton, about 1 GB, and outlines-core compiles regular expressions only); numbers in
`benchmarks/grammar_masks.py`. Needs the `grammar` extra (`plait-hf[grammar]`).

End of sequence: the grammar decides where the text may end; the sampler's stop tokens are allowed
exactly there, and they are the only tokens left once the grammar can take nothing more (the
sampler forces the end). llguidance's own EOS bit is not used: a stop token never reaches the
grammar.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it does not allow."""


class GrammarVocabulary:
    """A tokenizer's vocabulary as llguidance sees it; build one per tokenizer (about a second
    for 50k tokens) and make a matcher per sampled sequence from it."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        if "ByteLevel" in str(tokenizer.backend_tokenizer.decoder):
            table = llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size))
            self._tokenizer = llguidance.LLTokenizer(table, n_vocab=vocab_size)
        else:  # e.g. SentencePiece: llguidance's own reading (every added token special)
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A matcher at the start of `grammar`; GrammarError names what is wrong with it."""
        import llguidance

        try:
            compiled = llguidance.grammar_from("ebnf", grammar)
        except ValueError as exc:
            raise GrammarError(f"the grammar does not compile: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, compiled)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        return GrammarMatcher(matcher, self)


class _TokenTable:
    """A Hugging Face byte-level BPE tokenizer as llguidance's `TokenizerWrapper` takes it: the
    bytes of every token id, and which ids are special.

    Not `llguidance.hf.from_tokenizer`: it makes every added token special (text cannot match
    it), but Qwen's `<tool_call>`, `</tool_call>` and `<think>` are added tokens that are text
    (special: false), which the model writes and a grammar's literal "<tool_call>" must match, as
    in xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
        added = tokenizer.added_tokens_decoder
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token_id, text in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))):
            if token_id in added:
                self.tokens.append(added[token_id].content.encode())
                if added[token_id].special:
                    self.special_token_ids.append(token_id)
            elif text is None or any(c not in byte_of for c in text):
                self.tokens.append(b"")  # a row past the tokenizer (padded embedding): never text
                self.special_token_ids.append(token_id)
            else:
                self.tokens.append(bytes(byte_of[c] for c in text))
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher: Any, vocabulary: GrammarVocabulary) -> None:
        import llguidance.numpy

        self._matcher = matcher
        self._vocabulary = vocabulary
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocabulary.vocab_size)
        self._eos = vocabulary._tokenizer.eos_token

    @property
    def complete(self) -> bool:
        """Nothing more may follow: only a stop token (or nothing) comes next."""
        return bool(self._matcher.is_stopped())

    def allowed(self, stop_ids: Iterable[int]) -> np.ndarray:
        """(vocab_size,) bool: the tokens that may come next, `stop_ids` where the text may end."""
        import llguidance.numpy

        allowed = np.zeros(self._vocabulary.vocab_size, dtype=bool)
        if not self.complete:
            llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
            allowed[:] = bits[: allowed.size].astype(bool)
            allowed[self._eos] = False  # llguidance's EOS bit: where the grammar accepts
        if self._matcher.is_accepting():
            allowed[[t for t in stop_ids if 0 <= t < allowed.size]] = True
        return allowed

    def advance(self, token: int) -> None:
        """Take a sampled token that is not a stop token."""
        if not self._matcher.consume_token(token):
            raise GrammarError(
                f"token {token} does not continue the grammar: {self._matcher.get_error()}"
            )
