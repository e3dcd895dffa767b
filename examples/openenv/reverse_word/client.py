"""A typed OpenEnv client of the reverse-word environment."""

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from .models import ReverseWordAction, ReverseWordObservation


class ReverseWordEnv(EnvClient[ReverseWordAction, ReverseWordObservation, State]):
    def _step_payload(self, action: ReverseWordAction) -> dict:
        return {"message": action.message}

    def _parse_result(self, payload: dict) -> StepResult[ReverseWordObservation]:
        observation = ReverseWordObservation(
            **payload.get("observation", {}),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(observation, payload.get("reward"), payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)
