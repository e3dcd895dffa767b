"""Text to token ids the way inference engines do it, with chosen special-token text kept as text.

vLLM and SGLang render a chat template to a string and encode it with the model's tokenizer, which
splits out added tokens first: a message that spells "<|im_end|>" gets the control token. That is
the default here too. Renderers keep a special token's text as ordinary text where that is what
the model saw or wrote: a stop token spelled inside an assistant turn was sampled as ordinary
tokens (the stop token itself would have ended the turn), and some users ask that no message text
ever become a control token.
"""

from __future__ import annotations

import copy
import functools
import re
import weakref
from collections.abc import Callable
from typing import Any

_PLAIN_ENCODERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_ENCODERS: weakref.WeakKeyDictionary[Any, TokenEncoder] = weakref.WeakKeyDictionary()


def plain_text_encoder(tokenizer: Any) -> Any:
    """A copy of the tokenizer's backend that encodes special-token text as plain text (one per
    tokenizer: copying a 150k-token vocabulary takes seconds). Added tokens that are not special
    (e.g. Qwen's `<think>`) are still split out, as the tokenizer does."""
    encoder = _PLAIN_ENCODERS.get(tokenizer)
    if encoder is None:
        encoder = copy.deepcopy(tokenizer.backend_tokenizer)
        encoder.encode_special_tokens = True
        _PLAIN_ENCODERS[tokenizer] = encoder
    return encoder


class TokenEncoder:
    """Encodes text as `tokenizer.encode` does, except where the caller keeps a special token's
    text as text. Get one with `TokenEncoder.of(tokenizer)`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = {
            token.content: int(token_id)
            for token_id, token in tokenizer.added_tokens_decoder.items()
        }
        self.added = added
        self.special_tokens = frozenset(
            token.content for token in tokenizer.added_tokens_decoder.values() if token.special
        )
        # Longest first, so that a token that contains another wins (as the tokenizer matches).
        self._pattern = re.compile(
            "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        )

    @classmethod
    def of(cls, tokenizer: Any) -> TokenEncoder:
        encoder = _ENCODERS.get(tokenizer)
        if encoder is None:
            encoder = _ENCODERS[tokenizer] = cls(tokenizer)
        return encoder

    @functools.cached_property
    def _plain(self) -> Any:
        return plain_text_encoder(self.tokenizer)

    def encode(
        self, text: str, keep_as_text: Callable[[int, str], bool] | None = None
    ) -> list[int]:
        """`text` as the tokenizer encodes it (no BOS/EOS added); a special token whose text starts
        at offset `start` stays text when `keep_as_text(start, token)` is true."""
        if not text:
            return []
        kept = (
            []
            if keep_as_text is None
            else [
                m
                for m in self._pattern.finditer(text)
                if m.group() in self.special_tokens and keep_as_text(m.start(), m.group())
            ]
        )
        if not kept:
            # The tokenizer itself (not its backend: `encode(split_special_tokens=...)` leaves
            # its flag on the shared backend).
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        kept_starts = {m.start() for m in kept}
        ids: list[int] = []
        position = 0
        # Split out the added tokens that stay tokens, as the tokenizer would, and encode the
        # text between with the plain encoder, in which the kept special tokens are text.
        for match in self._pattern.finditer(text):
            if match.start() in kept_starts:
                continue
            ids += self._encode_plain(text[position : match.start()])
            ids.append(self.added[match.group()])
            position = match.end()
        ids += self._encode_plain(text[position:])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._plain.encode(text, add_special_tokens=False).ids) if text else []
