"""Check that the files the documentation names exist: `python scripts/lint/docs_links.py`.

Prints `FILE:LINE: missing PATH` for each broken reference and exits 1 if there is one.
Standard library only, so `make lint` can run it with any Python 3.11.

Which documents: every `*.md` file of the repository (README.md, docs/, each distribution's and
example's README and notes), except files under a `src/` folder (package data, e.g. a note on where
a vendored file came from, which names files of other projects) and under hidden or
.gitignore'd folders (`.venv/`, `runs/`, ...).

What is checked, outside fenced code blocks (``` or ~~~): fenced blocks hold commands, their
output, configs and code, whose paths are often made by the command or relative to where it runs.

1. Markdown link targets, `[text](target)`, `![alt](target)` and `[label]: target`, that are not
   URLs (`scheme:...`) or bare `#anchors`. The `#anchor` and `?query` are dropped and the rest must
   exist relative to the document's folder (a leading `/`: relative to the repository root), as
   GitHub resolves it. Anchors themselves are not checked.

2. Repository paths written in inline code or prose: a whitespace-separated word (surrounding
   parentheses, quotes, `*` emphasis and sentence punctuation stripped; a `:LINE` or `#anchor`
   suffix dropped) made of letters, digits and `_ . + -` components joined by `/`, with at least
   one `/` (a bare file name is not placed anywhere, so it is not checked), that either
   ends in a file extension of REPOSITORY_EXTENSIONS (`plugins/torch/README.md`,
   `tests/test_x.py`) or starts with a top-level folder of the repository (`plugins/torch/`,
   `examples/plugins/csv_sink`). It must exist relative to the document's folder, the document's
   distribution (the nearest folder above it with a pyproject.toml), the repository root, or the
   `src/` folder of a distribution whose package it starts with (`plait_torch/models.py`); a
   leading `./` is dropped (`pip install ./core` runs at the root), a leading `../` is relative to
   the document's folder only.

Not checked, by design (they name no file of this repository, so they cannot be verified here):
   - words with glob or placeholder characters (`reference/*.md`, `src/plait_<name>/`,
     `time/{train,sample}`, `$VENV/bin/python`), or with a component in capitals, which is a
     placeholder (`RUN_DIR/dashboard.png`, `DIR/sessions.jsonl`);
   - absolute paths and paths under `~` (`/tmp/x`, `~/.cache/plait`): outside the repository;
   - paths under a folder that .gitignore ignores (`runs/...`, `.venvs/vllm`): made by runs and
     tools, not kept in the repository;
   - URLs, `name=value`, `user@host` and `package==version` words (they contain `:`, `=` or `@`);
   - slashed words that are not paths: metric names (`policy/entropy`), `and/or`, `tokens/s`,
     model ids (`Qwen/Qwen3-0.6B`): no repository extension and no top-level folder.

Any other path-like word is checked, whatever its first folder: `reference/metrics.md` is reported
when no `reference/` folder holds it. So a file of another project is named by its module
(`sglang.srt.managers.io_struct`) or by a link to where it lives, and a slashed path in these
documents always means this repository.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

REPOSITORY = Path(__file__).resolve().parents[2]

REPOSITORY_EXTENSIONS = frozenset(
    {"py", "pyi", "md", "toml", "json", "jsonl", "yaml", "yml", "sh", "txt", "cfg", "ini"}
    | {"jinja", "png", "svg", "csv", "html"}
)
"""The kinds of file this repository keeps; a slashed word ending in another extension (a model's
`.safetensors`, a version's `.6B`) is not taken for a repository path."""

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
LINK_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
PATH_WORD = re.compile(r"^(?:\.{1,2}/)*[\w.+-]+(?:/[\w.+-]+)+/?$")
PLACEHOLDER_COMPONENT = re.compile(r"^[A-Z][A-Z0-9_]*$")
LOCATION_SUFFIX = re.compile(r"(?::\d+(?::\d+)?|#[\w-]*)$")
LEADING_PUNCTUATION = "(\"'*"
TRAILING_PUNCTUATION = ".,;:)\"'!?*"


def ignored_folders(root: Path) -> set[str]:
    """The folder names .gitignore ignores wholesale (`runs/`, `.venvs/`)."""
    gitignore = root / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.is_file() else []
    return {
        line.strip().strip("/")
        for line in lines
        if line.strip().endswith("/") and not re.search(r"[*?\[!#]", line)
    }


def walk(root: Path, skipped: set[str]) -> Iterator[tuple[Path, list[str]]]:
    """Each folder of the repository with its files, leaving out hidden and ignored folders and
    the `src/` folders (package data)."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(
            name
            for name in subfolders
            if not name.startswith(".") and name not in skipped and name != "src"
        )
        yield Path(folder), sorted(files)


class Checker:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.skipped = ignored_folders(root) | {"__pycache__", "node_modules"}
        self.top_level = {
            p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
        } - self.skipped
        self.documents: list[Path] = []
        self.package_sources: dict[str, list[Path]] = {}
        """The `src/` folders of the distributions, by the packages they hold."""
        for folder, files in walk(root, self.skipped):
            self.documents += [folder / name for name in files if name.endswith(".md")]
            src = folder / "src"
            if "pyproject.toml" in files and src.is_dir():
                for package in src.iterdir():
                    if package.is_dir() and not package.name.startswith((".", "_")):
                        self.package_sources.setdefault(package.name, []).append(src)

    def distribution_root(self, document: Path) -> Path:
        for folder in document.parents:
            if (folder / "pyproject.toml").is_file() or folder == self.root:
                return folder
        return self.root

    def check(self, document: Path) -> Iterator[tuple[int, str]]:
        fence = ""
        for number, line in enumerate(document.read_text().splitlines(), 1):
            opening = FENCE.match(line)
            marker = opening.group(1) if opening else ""
            if fence:
                if marker.startswith(fence) and not line.strip(" " + fence[0]):
                    fence = ""  # a closing fence: the same character, at least as long, alone
                continue
            if marker:
                fence = marker
                continue
            missing = [
                t
                for t in self.link_targets(CODE_SPAN.sub(" ", line))
                if not self.link_exists(document, t)
            ]
            missing += [w for w in self.path_words(line) if not self.path_exists(document, w)]
            for path in dict.fromkeys(missing):  # a link definition's target is a path word too
                yield number, path

    def link_targets(self, prose: str) -> Iterator[str]:
        targets = [m.group(1) for m in INLINE_LINK.finditer(prose)]
        definition = LINK_DEFINITION.match(prose)
        if definition:
            targets.append(definition.group(1))
        for target in targets:
            if not target.startswith("#") and not URL_SCHEME.match(target):
                yield unquote(target.split("#")[0].split("?")[0])

    def link_exists(self, document: Path, target: str) -> bool:
        base = self.root if target.startswith("/") else document.parent
        return (base / target.lstrip("/")).exists()

    def path_words(self, line: str) -> Iterator[str]:
        for raw in line.replace("`", " ").split():
            word = LOCATION_SUFFIX.sub(
                "", raw.lstrip(LEADING_PUNCTUATION).rstrip(TRAILING_PUNCTUATION)
            )
            if not PATH_WORD.match(word):  # globs, placeholders, URLs, absolute paths, a=b
                continue
            components = [c for c in word.split("/") if c and c not in (".", "..")]
            if components[0] in self.skipped or any(
                PLACEHOLDER_COMPONENT.match(c) for c in components
            ):
                continue
            extension = components[-1].rpartition(".")[2] if "." in components[-1] else ""
            if word.endswith("/"):
                extension = ""
            if extension in REPOSITORY_EXTENSIONS or components[0] in self.top_level:
                yield word

    def path_exists(self, document: Path, word: str) -> bool:
        if word.startswith("../"):
            return (document.parent / word).exists()
        word = word.removeprefix("./")  # `pip install ./core`: a command run where the doc says
        bases = [document.parent, self.distribution_root(document), self.root]
        bases += self.package_sources.get(word.split("/")[0], [])
        return any((base / word).exists() for base in bases)


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else REPOSITORY
    checker = Checker(root)
    broken = 0
    for document in checker.documents:
        for number, path in checker.check(document):
            print(f"{document.relative_to(root)}:{number}: missing {path}")
            broken += 1
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
