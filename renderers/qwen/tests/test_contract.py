"""The renderer contract kit, run against every Qwen renderer (thinking on and off)."""

from __future__ import annotations

from typing import Any

import pytest

from plait_qwen.chatml import QwenOptions
from plait_qwen.qwen3 import Qwen3InstructRenderer, Qwen3KeepReasoningRenderer, Qwen3Renderer
from plait_qwen.qwen3_5 import Qwen35KeepReasoningRenderer, Qwen35Renderer
from plait_testing.renderer import RendererContract


class TestQwen3(RendererContract):
    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen3Renderer:
        return Qwen3Renderer(qwen3_tokenizer)


class TestQwen3NoThinking(RendererContract):
    reasons = False

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen3Renderer:
        return Qwen3Renderer(qwen3_tokenizer, QwenOptions(enable_thinking=False))


class TestQwen3KeepReasoning(RendererContract):
    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen3KeepReasoningRenderer:
        return Qwen3KeepReasoningRenderer(qwen3_tokenizer)


class TestQwen3KeepReasoningNoThinking(RendererContract):
    reasons = False

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen3KeepReasoningRenderer:
        return Qwen3KeepReasoningRenderer(qwen3_tokenizer, QwenOptions(enable_thinking=False))


class TestQwen3Instruct2507(RendererContract):
    reasons = False

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen3InstructRenderer:
        return Qwen3InstructRenderer(qwen3_tokenizer)


class TestQwen35(RendererContract):
    unsupported = frozenset({"system_mid_conversation"})
    # The official template writes an empty block as <think> "\n\n" (one BPE token) where the
    # prompt ended in <think> "\n": its supervised example cannot extend its prompt.
    extends_generation_prompt = False

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen35Renderer:
        return Qwen35Renderer(qwen3_tokenizer)


class TestQwen35NoThinking(TestQwen35):
    reasons = False

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen35Renderer:
        return Qwen35Renderer(qwen3_tokenizer, QwenOptions(enable_thinking=False))


class TestQwen35KeepReasoning(TestQwen35):
    extends_generation_prompt = True

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen35KeepReasoningRenderer:
        return Qwen35KeepReasoningRenderer(qwen3_tokenizer)


class TestQwen35KeepReasoningNoThinking(TestQwen35):
    extends_generation_prompt = True
    reasons = False

    @pytest.fixture
    def renderer(self, qwen3_tokenizer: Any) -> Qwen35KeepReasoningRenderer:
        return Qwen35KeepReasoningRenderer(qwen3_tokenizer, QwenOptions(enable_thinking=False))
