"""Renderer factories: `factory(model, *, options) -> Renderer` (see `plait.hookspecs`)."""

from __future__ import annotations

from plait.api import ResolvedModel
from plait_hf.chat_template import load_tokenizer
from plait_qwen.chatml import QwenOptions, QwenRenderer
from plait_qwen.qwen3 import Qwen3InstructRenderer, Qwen3KeepReasoningRenderer, Qwen3Renderer
from plait_qwen.qwen3_5 import Qwen35KeepReasoningRenderer, Qwen35Renderer


def _build(
    cls: type[QwenRenderer], model: ResolvedModel, options: QwenOptions | None
) -> QwenRenderer:
    return cls(load_tokenizer(model.tokenizer_path), options)


def qwen3(model: ResolvedModel, *, options: QwenOptions | None = None) -> QwenRenderer:
    return _build(Qwen3Renderer, model, options)


def qwen3_keep_reasoning(
    model: ResolvedModel, *, options: QwenOptions | None = None
) -> QwenRenderer:
    return _build(Qwen3KeepReasoningRenderer, model, options)


def qwen3_instruct_2507(
    model: ResolvedModel, *, options: QwenOptions | None = None
) -> QwenRenderer:
    return _build(Qwen3InstructRenderer, model, options)


def qwen3_5(model: ResolvedModel, *, options: QwenOptions | None = None) -> QwenRenderer:
    return _build(Qwen35Renderer, model, options)


def qwen3_5_keep_reasoning(
    model: ResolvedModel, *, options: QwenOptions | None = None
) -> QwenRenderer:
    return _build(Qwen35KeepReasoningRenderer, model, options)
