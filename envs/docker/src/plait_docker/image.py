"""The sandbox image, built locally without a registry: a debootstrap root file system +
`docker import`.

The tag is a hash of the recipe (Debian suite, packages, users, Python version), so a changed recipe
gets a new tag, and building an image whose tag exists does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs
import docker
import docker.errors
import structlog

from plait.api import EngineError, PlaitError
from plait_docker.engine import LABEL_IMAGE, LABEL_RECIPE, connect

log = structlog.get_logger("plait_docker.image")

REPOSITORY = "plait-sandbox"
# Bump when the build steps below change in a way the recipe fields do not capture.
BUILD_STEPS_VERSION = 1
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Trimmed from the root file system: documentation and package caches the sandbox never reads.
TRIMMED_PATHS = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
)


@attrs.frozen
class ImageRecipe:
    """What goes into the sandbox image. Every field is part of the tag's hash."""

    suite: str = "bookworm"
    # python3 runs the tasks (stdlib only: HumanEval and the own tasks need nothing else);
    # tini is PID 1, reaping the orphans of killed programs.
    packages: tuple[str, ...] = ("python3", "tini")
    python_version: str = "3.11"
    init_uid: int = 10000  # PID 1 runs as this user
    sandbox_uid: int = 10001  # untrusted code runs as this user; it cannot signal PID 1
    work_dir: str = "/work"

    def digest(self) -> str:
        fields = attrs.asdict(self)
        fields["build_steps_version"] = BUILD_STEPS_VERSION
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @property
    def tag(self) -> str:
        return f"{REPOSITORY}:{self.digest()[:16]}"


DEFAULT_RECIPE = ImageRecipe()


def default_image() -> str:
    return DEFAULT_RECIPE.tag


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def require_image(client: docker.DockerClient, tag: str) -> None:
    if not image_exists(client, tag):
        raise EngineError(
            f"the sandbox image {tag} is not built on this Docker engine",
            fix="run `plait-docker build-image` (or `plait docker build-image`); it needs root, "
            "debootstrap and access to a Debian mirror, and takes about two minutes",
        )


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line format), else the default."""
    deb822 = Path("/etc/apt/sources.list.d/debian.sources")
    if deb822.is_file():
        match = re.search(r"^URIs:\s*(\S+)", deb822.read_text(), re.MULTILINE)
        if match and "security" not in match.group(1):
            return match.group(1)
    one_line = Path("/etc/apt/sources.list")
    if one_line.is_file():
        match = re.search(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+\s+main", one_line.read_text(), re.MULTILINE
        )
        if match:
            return match.group(1)
    return DEFAULT_MIRROR


def build_image(
    recipe: ImageRecipe = DEFAULT_RECIPE,
    *,
    mirror: str | None = None,
    force: bool = False,
    client: docker.DockerClient | None = None,
) -> str:
    """Build the sandbox image unless its tag exists (or `force`); returns the tag."""
    client = client or connect()
    tag = recipe.tag
    if image_exists(client, tag) and not force:
        log.info("sandbox image already built", tag=tag)
        return tag
    _check_build_prerequisites()
    mirror = mirror or debian_mirror()
    with tempfile.TemporaryDirectory(prefix="plait-sandbox-image-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log.info("debootstrap", suite=recipe.suite, packages=recipe.packages, mirror=mirror)
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(recipe.packages)}",
                recipe.suite,
                str(rootfs),
                mirror,
            ],
            "debootstrap",
        )
        _customise_rootfs(rootfs, recipe)
        archive = Path(tmp) / "rootfs.tar"
        _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), "."], "tar")
        repository, _, version = tag.partition(":")
        log.info("docker import", tag=tag, size_mb=round(archive.stat().st_size / 2**20))
        client.api.import_image(
            src=str(archive),
            repository=repository,
            tag=version,
            changes=[
                f"USER {recipe.init_uid}:{recipe.init_uid}",
                f"WORKDIR {recipe.work_dir}",
                "ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1",
                'ENTRYPOINT ["/usr/bin/tini", "--"]',
                'CMD ["sleep", "infinity"]',
                f"LABEL {LABEL_IMAGE}=1 {LABEL_RECIPE}={recipe.digest()}",
            ],
        )
    _verify(client, recipe)
    log.info("sandbox image built", tag=tag)
    return tag


def _check_build_prerequisites() -> None:
    if os.geteuid() != 0:
        raise PlaitError(
            "building the sandbox image needs root (debootstrap creates device nodes and chowns "
            "files)",
            fix="run `plait-docker build-image` as root",
        )
    if shutil.which("debootstrap") is None:
        raise PlaitError("debootstrap is not installed", fix="apt-get install -y debootstrap")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise PlaitError(
            f"{what} failed with exit code {proc.returncode}:\n{tail}",
            fix="check the mirror (--mirror URL) and the disk space under /var/tmp",
        )


def _customise_rootfs(rootfs: Path, recipe: ImageRecipe) -> None:
    with (rootfs / "etc/passwd").open("a") as passwd:
        passwd.write(
            f"sandbox-init:x:{recipe.init_uid}:{recipe.init_uid}::/nonexistent:/usr/sbin/nologin\n"
        )
        passwd.write(
            f"sandbox:x:{recipe.sandbox_uid}:{recipe.sandbox_uid}::{recipe.work_dir}:/bin/sh\n"
        )
    with (rootfs / "etc/group").open("a") as group:
        group.write(f"sandbox-init:x:{recipe.init_uid}:\nsandbox:x:{recipe.sandbox_uid}:\n")
    (rootfs / recipe.work_dir.lstrip("/")).mkdir(exist_ok=True)
    for relative in TRIMMED_PATHS:
        target = rootfs / relative
        if target.is_dir():
            shutil.rmtree(target)
            target.mkdir()


def _verify(client: docker.DockerClient, recipe: ImageRecipe) -> None:
    """Run the new image once: its Python must be the recipe's version, or the image is removed."""
    script = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        out = client.containers.run(
            recipe.tag,
            ["python3", "-c", script],
            entrypoint=[],
            network_mode="none",
            remove=True,
            user=str(recipe.sandbox_uid),
        )
    except docker.errors.DockerException as exc:
        client.images.remove(recipe.tag, force=True)
        raise PlaitError(f"the freshly built sandbox image does not run Python: {exc}") from exc
    version = out.decode().strip()
    if version != recipe.python_version:
        client.images.remove(recipe.tag, force=True)
        raise PlaitError(
            f"the sandbox image has Python {version}, the recipe asks for {recipe.python_version}",
            fix=f"pick the Debian suite that ships Python {recipe.python_version}",
        )
