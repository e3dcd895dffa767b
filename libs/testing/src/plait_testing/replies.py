"""An engine and renderer for episode tests that need no model: the engine replies given texts in
turn (and keeps the prompts it saw), the renderer writes each message as "role: text" in bytes.

    engine = Replies("42", "#### 72")
    trajectory = await run_episode(env, task, engine, BytesRenderer(), config)
    engine.prompts[1]   # what the model was shown on its second call
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.api import (
    Message,
    ModelInput,
    ParseTermination,
    SampledSequence,
    SampleResponse,
    SamplingParams,
)


class BytesRenderer:
    """Each message as "role: text\\n" in bytes; a response is its bytes."""

    tokenizer = None
    has_extension_property = False

    def build_generation_prompt(self, messages: Sequence[Message], **_: Any) -> ModelInput:
        return ModelInput.from_ints(
            list("".join(f"{m.role}: {m.content}\n" for m in messages).encode())
        )

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        return Message("assistant", bytes(tokens).decode()), ParseTermination.EOS

    def bridge_to_next_turn(self, *_: Any) -> None:
        return None

    def stop_sequences(self) -> list[int]:
        return []


class Replies:
    """An engine that gives `replies` in turn, and keeps the prompts it saw."""

    weight_version = 0

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.prompts: list[str] = []

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        self.prompts.append(bytes(prompt.to_ints()).decode())
        tokens = list(self.replies.pop(0).encode())
        return SampleResponse([SampledSequence(tokens, [-0.5] * len(tokens), "stop")])
