"""The core stays small: `python scripts/lint/core_size.py` fails when core/src/plait holds more
than BUDGET lines of Python.

Lines are counted as they stand, blank lines, comments and docstrings included; `make lint` runs
`ruff format --check` first, so they are counted as the formatter writes them and a budget cannot
be met by packing lines. What is not a contract or the run loop moves to a library under libs/.
Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path

BUDGET = 4800
CORE = Path(__file__).resolve().parents[2] / "core" / "src" / "plait"


def main() -> int:
    sizes = {
        path.relative_to(CORE).as_posix(): len(path.read_text().splitlines())
        for path in sorted(CORE.rglob("*.py"))
    }
    total = sum(sizes.values())
    if total <= BUDGET:
        print(f"core: {total} lines of {BUDGET}")
        return 0
    largest = ", ".join(f"{name} {n}" for name, n in sorted(sizes.items(), key=lambda i: -i[1])[:5])
    print(
        f"core: {total} lines, over its budget of {BUDGET}; move what is not a contract or the "
        f"run loop into a library under libs/ (largest: {largest})",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
