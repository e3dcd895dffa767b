"""Models shared by the proxy's tests: tiny-qwen3, and tiny-qwen3 rewritten so that greedy
sampling writes one tool call (`plait_testing.scripted`), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.api import ResolvedModel

NEWLINE = 198  # the last token of every Qwen generation prompt ("<|im_start|>assistant\n")
TOOL_CALL = (
    '<think>add them</think>\n\n\n<tool_call>{"name":"calculator","arguments":{"expression":"7*6"}}'
    "</tool_call><|im_end|>"
)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    pytest.importorskip("plait_torch", reason="needs the reference engine (plait-torch)")
    from plait_testing.models import materialize_model

    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


@pytest.fixture(scope="session")
def tool_calling_qwen3(tiny_qwen3: ResolvedModel) -> tuple[ResolvedModel, list[int]]:
    """A checkpoint whose greedy completion of any prompt is TOOL_CALL, and that completion's ids
    (tokenized non-canonically, so that re-tokenizing the text would change them)."""
    from plait_hf.chat_template import load_tokenizer
    from plait_testing.scripted import build_scripted_qwen3, script_tokens

    script = script_tokens(
        load_tokenizer(tiny_qwen3.path),
        TOOL_CALL,
        avoid=[NEWLINE],
        split={"calculator": ["calcul", "ator"]},
    )
    dest = tiny_qwen3.path.parent / "tool-calling-qwen3"
    build_scripted_qwen3(tiny_qwen3.path, dest, NEWLINE, script)
    return ResolvedModel("tool-calling-qwen3", dest, dest), script
