"""What a run knows between steps: where it is, which tasks come next, and the seed of every
sample."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import attrs
import numpy as np

from plait.components import Components
from plait.config import RunConfig
from plait.errors import PlaitError
from plait.trajectory import Trajectory

_SEED_MASK = (1 << 62) - 1
EVAL_GREEDY, EVAL_SAMPLED = -1, -2
"""The seed streams of evaluation (training steps use streams 0, 1, 2, ...)."""


def sample_seed(run_seed: int, stream: int, slot: int) -> int:
    """The sampling seed of one episode: `stream` is the step whose batch it belongs to (or an
    evaluation stream), `slot` its place in that batch (group * group_size + sample)."""
    return ((run_seed * 1_000_003 + stream) * 100_003 + slot) & _SEED_MASK


class TaskSampler:
    """Deterministic task order: every task once per epoch, in a seeded order per epoch.

    Position p (counted over the whole run) maps to a task index, so a resumed run continues
    exactly where the checkpoint left off.
    """

    def __init__(self, num_tasks: int, seed: int) -> None:
        if num_tasks <= 0:
            raise PlaitError(
                "the training split has no tasks", fix="check env.train_split and env.options"
            )
        self.num_tasks = num_tasks
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_tasks)
        if self.num_tasks > 1_000_000:  # too many to permute: a seeded affine walk instead
            rng = np.random.default_rng([self.seed, epoch])
            stride = int(rng.integers(1, self.num_tasks))
            while math.gcd(stride, self.num_tasks) != 1:
                stride += 1
            return (int(rng.integers(0, self.num_tasks)) + offset * stride) % self.num_tasks
        if epoch not in self._cache:
            self._cache = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_tasks)
            }
        return int(self._cache[epoch][offset])

    def batch(self, start: int, size: int) -> list[int]:
        return [self.index(p) for p in range(start, start + size)]


@attrs.frozen
class TrainedSample:
    """One sample of a batch, and where it came from (for the ledger and for resume)."""

    position: int
    """The prompt's place in the run's task order (`Run.positions`)."""
    index: int
    """Its number within the prompt's group."""
    task_index: int
    attempt: int
    """The `RunState.attempt` of the process that sampled it."""
    trajectory: Trajectory

    def ledger_entry(self) -> list[int]:
        tokens = [t for turn in self.trajectory.turns for t in turn.completion.tokens]
        digest = zlib.crc32(json.dumps(tokens).encode())
        for turn in self.trajectory.turns:  # what trains must be what was sampled, routing included
            if turn.completion.routed_experts is not None:
                digest = zlib.crc32(turn.completion.routed_experts.data.tobytes(), digest)
        return [self.position, self.index, self.task_index, self.attempt, digest]


Batch = list[list[TrainedSample]]
"""A step's samples: one group per prompt, in task order."""


@attrs.define
class RunState:
    """The controller's own state; a checkpoint holds it beside the trainer's."""

    step: int = 0
    samples_seen: int = 0
    attempt: int = 0
    """0 for a fresh start, else the loaded checkpoint's attempt + 1: a sample whose attempt is
    lower than the process's was sampled before the checkpoint it resumed from."""
    eval_history: list[tuple[int, float]] = attrs.field(factory=list)
    extra_prompts: int = 0
    """Prompts `rl.dynamic_sampling` took beyond groups_per_batch a step, over the steps done."""


@attrs.define
class Run:
    """One run: its config, components, directory, state and task order."""

    config: RunConfig
    components: Components
    run_dir: Path
    state: RunState
    sampler: TaskSampler

    def positions(self, step: int) -> range:
        """The task-order positions of `step`'s prompts (with dynamic sampling, its first ones:
        it may go on to the next)."""
        start = step * self.config.rl.groups_per_batch + self.state.extra_prompts
        return range(start, start + self.config.rl.groups_per_batch)

    def seed(self, position: int, index: int) -> int:
        """The sampling seed of sample `index` of the prompt at `position`."""
        rl = self.config.rl
        step, group = divmod(position, rl.groups_per_batch)
        return sample_seed(self.config.run.seed, step, group * rl.group_size + index)
