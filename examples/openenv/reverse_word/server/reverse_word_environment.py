"""Reverse a word: reward 1.0 for the right answer, which ends the episode; a wrong one earns 0.0
and another try, up to three in all."""

import random
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import ReverseWordAction, ReverseWordObservation
except ImportError:
    from models import ReverseWordAction, ReverseWordObservation

WORDS = ["planet", "garden", "silver", "window", "rocket", "candle", "forest", "bridge"]
ATTEMPTS = 3


class ReverseWordEnvironment(Environment):
    """Each episode asks for one word, chosen by the reset seed, written backwards."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True  # every session has its own instance

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._word = WORDS[0]

    def reset(self, seed=None, episode_id=None) -> ReverseWordObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._word = random.Random(seed).choice(WORDS)
        return ReverseWordObservation(
            prompt=f"Write the word '{self._word}' backwards. Answer with the word only.",
            attempts_left=ATTEMPTS,
            done=False,
            reward=None,
        )

    def step(self, action: ReverseWordAction) -> ReverseWordObservation:  # type: ignore[override]
        self._state.step_count += 1
        solved = action.message.strip().lower() == self._word[::-1]
        left = ATTEMPTS - self._state.step_count
        feedback = "Correct." if solved else f"Not quite; try again ({left} left)."
        return ReverseWordObservation(
            prompt=feedback,
            attempts_left=left,
            done=solved or left == 0,
            reward=1.0 if solved else 0.0,
        )

    @property
    def state(self) -> State:
        return self._state
