"""skyrl-gym environments in plait (needs `pip install 'plait-sdk[skyrl]'`).

skyrl-gym (SkyRL's environment library) makes one environment per dataset row:
`skyrl_gym.make(id, env_config=..., extras=row)`; `init(prompt)` gives the opening chat messages
and `step(reply)` takes the model's whole reply and returns `observations` (chat messages to
append), `reward`, `done` and `metadata`. The reply itself is the action, so the gymnasium adapter
(`plait_sdk.gym`: tasks are seeds, actions go through an `act` tool) does not fit; this adapter is
an SDK environment instead:

- a task is a row of a SkyRL dataset (JSON Lines, one file per split): `prompt` (chat messages),
  optionally `env_class`, and the rest (`reward_spec`, `extra_info`, ...), which the environment
  gets as `extras` with `max_turns` added, as SkyRL's generator does;
- the model's plain reply goes to the terminal tool `reply`, which steps the environment. A step
  that is not `done` hands the turn back to the acting role (`plait.role`), so plait's rollout
  tells the model the observations as a user message and samples again, as SkyRL does; every
  step's reward is recorded (`rl.reward_reduce` combines them; `rl.max_turns` caps the replies).
"""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any, ClassVar

import attrs

from plait.api import ROLE_KEY, Message, TextBlock, ToolOutput, positive
from plait_sdk.environment import Environment, terminal
from plait_sdk.local import LocalEnvironment

SKYRL_GYM_VERSION = "0.4.0"
ROW_KEYS = ("prompt", "env_class")  # the row's keys that are not the environment's extras


def _skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError:
        raise ValueError(
            "skyrl_gym needs the skyrl-gym package, which is not installed: "
            f"pip install 'plait-sdk[skyrl]' (skyrl-gym=={SKYRL_GYM_VERSION})"
        ) from None
    return skyrl_gym


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


@attrs.frozen(kw_only=True)
class SkyRLGymOptions:
    """Options of `skyrl_gym`."""

    env: str
    """A skyrl-gym environment id (skyrl_gym.registry), e.g. gsm8k, gsm8k_multi_turn, aime."""
    data: dict[str, str]
    """Split name -> a JSON Lines file of SkyRL dataset rows."""
    env_config: dict[str, Any] = attrs.field(factory=dict)
    """The environment's `env_config` (SkyRL's `environment.skyrl_gym.<env>` section)."""
    max_turns: int = attrs.field(default=1, validator=positive)
    """Given to the environment in `extras`, as SkyRL's generator does (multi-turn ones read it)."""

    def __attrs_post_init__(self) -> None:
        ids = sorted(_skyrl_gym().registry)
        if self.env not in ids:
            close = difflib.get_close_matches(self.env, ids, n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise ValueError(
                f"env: {self.env!r} is not a skyrl-gym environment{hint}; its environments: "
                f"{', '.join(ids)}"
            )
        if not self.data:
            raise ValueError("data: give at least one split, e.g. data = { train = 'train.jsonl' }")
        for split, path in self.data.items():
            if not Path(path).is_file():
                raise ValueError(f"data.{split}: no file {path!r}")


def _check_row(row: Any, env: str, where: str) -> dict[str, Any]:
    """A dataset row, or ValueError naming `where` (file:line) and what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        raise ValueError(
            f"{where}: 'prompt' must be a list of chat messages "
            '({"role": "system" | "user" | "assistant", "content": str})'
        )
    if row.get("env_class", env) != env:
        raise ValueError(
            f"{where}: the row is for skyrl-gym environment {row['env_class']!r}, this one runs "
            f"{env!r} (options.env)"
        )
    return row


class SkyRLGymEnvironment(Environment):
    """A skyrl-gym environment on one dataset row; each reply is one `step`."""

    options: ClassVar[SkyRLGymOptions]

    @classmethod
    def list_splits(cls) -> list[str]:
        return list(cls.options.data)

    @classmethod
    @functools.cache
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        if split not in cls.options.data:
            raise KeyError(f"no split {split!r}; the splits are {list(cls.options.data)}")
        path = cls.options.data[split]
        with open(path, encoding="utf-8") as lines:
            return [
                _check_row(json.loads(line), cls.options.env, f"{path}:{number}")
                for number, line in enumerate(lines, 1)
                if line.strip()
            ]

    def setup(self) -> None:
        row = _check_row(self.task_spec, self.options.env, "task")
        from omegaconf import DictConfig  # skyrl-gym's own dependency; its environments read it

        extras = {k: v for k, v in row.items() if k not in ROW_KEYS}
        self.skyrl_env = _skyrl_gym().make(
            self.options.env,
            env_config=DictConfig(self.options.env_config),
            extras={**extras, "max_turns": self.options.max_turns},
        )
        conversation, _ = self.skyrl_env.init([dict(m) for m in row["prompt"]])
        self.conversation = [Message(m["role"], m["content"]) for m in conversation]

    def teardown(self) -> None:
        if hasattr(self, "skyrl_env"):  # setup may have failed before making it
            self.skyrl_env.close()

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock("\n\n".join(m.content for m in self.conversation))]

    async def get_messages(self) -> list[Message]:
        return list(self.conversation)

    @terminal
    def reply(self, text: str) -> ToolOutput:
        """Receives the model's reply: one step of the environment."""
        out = self.skyrl_env.step(text)
        observation = "\n\n".join(str(m.get("content", "")) for m in out["observations"])
        metadata = _jsonable(out.get("metadata") or {})
        if not out["done"]:
            metadata[ROLE_KEY] = self.task_spec.get(ROLE_KEY, "")  # the same role goes on
        reward = out.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(
                f"skyrl-gym environment {self.options.env!r} returned reward {reward!r}, not a "
                "number: its step() must return a float reward"
            )
        return ToolOutput(
            blocks=[TextBlock(observation)],
            reward=float(reward),
            finished=bool(out["done"]),
            metadata=metadata,
        )


def make_env(*, options: SkyRLGymOptions) -> LocalEnvironment:
    """The factory plait calls (`env.name = "skyrl_gym"`): the class with `options` bound."""
    bound = type("skyrl_gym", (SkyRLGymEnvironment,), {"options": options, "__module__": __name__})
    return LocalEnvironment(bound, name="skyrl_gym")
