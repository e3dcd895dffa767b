"""The actions and observations of the reverse-word environment."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class ReverseWordAction(Action):
    """One attempt: the word written backwards."""

    message: str = Field(..., description="The attempt")


class ReverseWordObservation(Observation):
    """What the player reads: the task at reset, then how the last attempt went."""

    prompt: str = Field(default="", description="What to do, or feedback on the last attempt")
    attempts_left: int = Field(default=0, description="Attempts the episode still allows")
