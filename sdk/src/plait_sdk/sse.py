"""Server-Sent Events framing as ORS uses it (as the official SDKs' servers send it).

A streamed result is `event: task_id` (the resume token), zero or more `event: chunk` pieces and a
last `event: end` piece; the receiver joins the pieces and parses JSON. A failure is one
`event: error`. While the work runs the server sends `: ping - <time>` comment lines.

The official clients strip *all* leading whitespace from a `data:` value, so a piece must never
start with whitespace; `chunk_text` moves cut points to keep that true.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

CHUNK_SIZE = 4096


def event(name: str, data: str = "") -> bytes:
    lines = data.split("\n") if data else [""]
    body = "".join(f"data: {line}\n" for line in lines)
    return f"event: {name}\n{body}\n".encode()


def ping_comment() -> bytes:
    return f": ping - {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n".encode()


def chunk_text(text: str, size: int = CHUNK_SIZE) -> list[str]:
    """`text` cut into pieces of about `size` characters, none starting with whitespace."""
    pieces: list[str] = []
    start = 0
    while start < len(text):
        stop = min(start + size, len(text))
        while stop < len(text) and text[stop].isspace():
            stop += 1
        pieces.append(text[start:stop])
        start = stop
    return pieces or [""]


def result_events(text: str, size: int = CHUNK_SIZE) -> Iterator[bytes]:
    pieces = chunk_text(text, size)
    for i, piece in enumerate(pieces):
        yield event("end" if i == len(pieces) - 1 else "chunk", piece)


async def parse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs from an SSE line stream, per the SSE spec (one space after the colon
    is stripped; comment lines are skipped; an event without a name is "message")."""
    name = ""
    data: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data or name:
                yield name or "message", "\n".join(data)
            name, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    if data or name:
        yield name or "message", "\n".join(data)
