"""`plait-docker` (also `plait docker`): build the sandbox image, clean up, show the state."""

from __future__ import annotations

import os
import sys

import click

from plait.api import PlaitError


@click.group(name="plait-docker")
def docker_commands() -> None:
    """Sandboxed code execution on a Docker engine."""


@docker_commands.command("build-image")
@click.option("--force", is_flag=True, help="Rebuild even if the image's tag exists.")
@click.option(
    "--mirror",
    default=None,
    metavar="URL",
    help="Debian mirror for debootstrap (default: the one apt uses on this machine).",
)
def build_image_command(force: bool, mirror: str | None) -> None:
    """Build the sandbox image locally (debootstrap + docker import); print its tag."""
    from plait.api import ensure_configured
    from plait_docker.image import build_image

    ensure_configured()
    click.echo(build_image(mirror=mirror, force=force))


@docker_commands.command()
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Remove every sandbox container, also those of running processes.",
)
def janitor(everything: bool) -> None:
    """Remove sandbox containers left behind by processes that are gone."""
    from plait_docker.engine import connect
    from plait_docker.sandbox import janitor as run_janitor

    removed = run_janitor(connect(), everything=everything)
    click.echo(f"removed {len(removed)} sandbox container(s)")


@docker_commands.command()
def status() -> None:
    """Show the engine, the sandbox image and the sandbox containers."""
    from plait_docker.engine import LABEL_SANDBOX, connect
    from plait_docker.image import default_image, image_exists

    client = connect()
    tag = default_image()
    containers = client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}=1"})
    click.echo(f"engine      Docker {client.version()['Version']} at {client.api.base_url}")
    image_state = (
        "built" if image_exists(client, tag) else "not built: run plait-docker build-image"
    )
    click.echo(f"image       {tag} ({image_state})")
    click.echo(f"containers  {len(containers)} sandbox container(s)")


def main() -> None:
    try:
        docker_commands.main(standalone_mode=False)
    except PlaitError as exc:
        if os.environ.get("PLAIT_TRACEBACK"):
            raise
        click.echo(f"error: {exc.message}", err=True)
        if exc.fix:
            click.echo(f"  fix: {exc.fix}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
