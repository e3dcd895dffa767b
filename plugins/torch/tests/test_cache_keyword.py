"""The inference engine passes its KV cache under the name the installed transformers takes:
`cache` (5.25 on), `past_key_values` before (5.17, on the lent GPU machines, silently ignores
`cache`, so every decode step ran without the prompt: found by scripts/gpu/check.sh --dry-run
under transformers 5.17, sampled logprobs off by ~0.3 from a full forward pass)."""

from __future__ import annotations

from typing import Any

from plait_torch.inference import cache_keyword


class _Renamed:
    def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...


class _Older:
    def forward(
        self, input_ids: Any = None, past_key_values: Any = None, **kwargs: Any
    ) -> None: ...


def test_cache_keyword_follows_the_forward_signature() -> None:
    assert cache_keyword(_Renamed()) == "cache"
    assert cache_keyword(_Older()) == "past_key_values"


def test_cache_keyword_of_the_installed_transformers() -> None:
    import inspect

    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config)
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
