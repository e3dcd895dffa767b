"""What `plait serve online` must not lose, appended as JSON lines to `<run dir>/online/`:

    answers.jsonl    {"id", "time", "version", "turns",    before the answer reaches its client
                      ["task", "text"]}
    feedback.jsonl   {"id", "reward", "time"}              before the feedback is acknowledged
    updates.jsonl    {"update", "ids"} |                   answers an update consumed or passed over
                     {"update", "stale"}
                     {"update", "promoted", "score", ...}  its verdict

so a server killed at any moment has on disk every answer it sent and every reward it
acknowledged; `replay` reads them back on restart. Each line is one `write` to a file opened for
appending, so the operating system holds it once the call returns, and keeps it when the process
dies; `fsync` also survives a crash of the machine, at a disk flush per line (on the event loop:
every request waits for it). A kill during a write leaves a cut last line, which nobody was told
about: reopening cuts it off.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
import structlog

from plait.api import Turn, from_json, fsync_dir, read_jsonl, to_json

log = structlog.get_logger("plait.online")

ANSWERS, FEEDBACK, UPDATES = "answers.jsonl", "feedback.jsonl", "updates.jsonl"


@attrs.define
class Answer:
    """One served answer as training data: the conversation's turns up to and including it."""

    id: str
    time: float
    version: int
    """The weight version that sampled its last token."""
    turns: tuple[Turn, ...]
    reward: float | None = None
    task: dict[str, Any] | None = None
    """The task the environment judges the answer's text on (the client's `x-plait-task`)."""
    text: str = ""


@attrs.define
class Replayed:
    """What an earlier server left: answers with or without a reward, not yet trained on, and
    the counts its status showed."""

    answers: list[Answer]
    rewarded: set[str]
    trained: set[str]
    updates: int
    answered: int = 0
    """Answers sent, all told."""
    dropped_stale: int = 0
    verdicts: list[dict[str, Any]] = attrs.field(factory=list)
    """Every update's outcome ({"update", "promoted", ...}; with "error" if it failed), in order."""


class OnlineLog:
    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.fsync = fsync
        self._files = {
            name: _open_repaired(directory / name) for name in (ANSWERS, FEEDBACK, UPDATES)
        }
        if fsync:
            fsync_dir(directory)

    def answered(self, answer: Answer) -> None:
        judged = {"task": answer.task, "text": answer.text} if answer.task is not None else {}
        self._append(
            ANSWERS,
            {
                "id": answer.id,
                "time": answer.time,
                "version": answer.version,
                "turns": to_json(list(answer.turns)),
                **judged,
            },
        )

    def rewarded(self, answer_id: str, reward: float) -> None:
        self._append(FEEDBACK, {"id": answer_id, "reward": reward, "time": time.time()})

    def updated(self, record: dict[str, Any]) -> None:
        self._append(UPDATES, record)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)

    def _append(self, name: str, record: dict[str, Any]) -> None:
        """One `write` of the whole line; if it fails, the file is cut back to where it was, so
        that no part of it sticks to the next record."""
        fd = self._files[name]
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, line) != len(line):
                raise OSError(f"a short write to {self.directory / name}")
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)
            raise


def _open_repaired(path: Path) -> int:
    """`path` opened for appending, cut back to its last complete line: a line a kill cut short
    was never acknowledged, and the next record must not be glued to it."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    size = os.fstat(fd).st_size
    if size:
        tail = os.pread(fd, min(size, 1 << 20), max(size - (1 << 20), 0))
        end = tail.rfind(b"\n")
        keep = max(size - (1 << 20), 0) + end + 1 if end >= 0 else 0
        if keep != size:
            log.warning("cutting a line a kill left unfinished", file=str(path), bytes=size - keep)
            os.ftruncate(fd, keep)
    return fd


def replay(directory: Path, *, since: float = 0.0) -> Replayed:
    """The answers, rewards and updates in `directory` (none if it is new); answers older than
    `since` (seconds since the epoch) come back only if they were rewarded."""
    rewards = {r["id"]: float(r["reward"]) for r in _records(directory / FEEDBACK)}
    trained: set[str] = set()
    updates = dropped_stale = 0
    verdicts = []
    for record in _records(directory / UPDATES):
        trained.update(record.get("ids", ()), record.get("stale", ()))
        updates = max(updates, int(record["update"]))
        dropped_stale += len(record.get("stale", ()))
        if "promoted" in record:
            verdicts.append(record)
    sent = _records(directory / ANSWERS)
    answers = [
        Answer(
            r["id"],
            float(r["time"]),
            int(r["version"]),
            tuple(from_json(list[Turn], r["turns"])),
            rewards.get(r["id"]),
            r.get("task"),
            r.get("text", ""),
        )
        for r in sent
        if r["id"] not in trained and (r["id"] in rewards or float(r["time"]) >= since)
    ]
    return Replayed(answers, set(rewards), trained, updates, len(sent), dropped_stale, verdicts)


def _records(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.exists() else []
