"""What plait's services share: JSON replies and errors, checked request fields, API keys, the
component a service runs (built from a run config), and serving until SIGINT or SIGTERM.

A request the service refuses is a 400 `{"error": {"message", "fix", "type"}}` (the component's
`DataError`s too), a missing or wrong key a 401, a component failure a 500 with its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import Response

from plait.api import ConfigError, DataError, PlaitError

log = structlog.get_logger("plait_remote")

Handler = Callable[..., Awaitable[Any]]


class BadRequest(Exception):
    """A request the service refuses (400)."""

    status = 400


class NotFound(BadRequest):
    """A request for something the service does not hold (404)."""

    status = 404


def reply(data: Any, status: int = 200) -> Response:
    # allow_nan: a logprob can be -inf (a token the model gives no mass), which JSON proper lacks
    return Response(
        json.dumps(data, allow_nan=True), status_code=status, media_type="application/json"
    )


def error(
    status: int, message: str, *, fix: str | None = None, kind: str | None = None
) -> Response:
    return reply({"error": {"message": message, "fix": fix, "type": kind}}, status)


def field(body: dict[str, Any], name: str, parse: Callable[[Any], Any]) -> Any:
    """`parse(body[name])`; a missing or unparsable field is a `BadRequest` that names it."""
    if name not in body:
        raise BadRequest(f"the body lacks {name!r}")
    try:
        return parse(body[name])
    except Exception as exc:  # cattrs and the attrs validators raise many kinds
        raise BadRequest(f"{name!r} is not valid: {exc}") from None


def endpoint(
    handler: Handler, *, name: str, api_key: str | None
) -> Callable[[Request], Awaitable[Response]]:
    """A route that checks the key, reads a JSON object body and answers `handler(body,
    **path_params)`, mapping every failure to its status."""

    async def answer(request: Request) -> Response:
        from plait_sdk.server import key_matches

        if api_key and not key_matches(request.headers, api_key):
            return error(
                401,
                "missing or wrong API key",
                fix="send it as Authorization: Bearer <key> (options.api_key)",
            )
        try:
            body = json.loads(await request.body() or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            return reply(await handler(body, **request.path_params))
        except json.JSONDecodeError as exc:
            return error(400, f"the body is not JSON: {exc}")
        except BadRequest as exc:
            return error(exc.status, str(exc))
        except DataError as exc:
            return error(400, exc.message, fix=exc.fix, kind="DataError")
        except PlaitError as exc:
            return error(500, exc.message, fix=exc.fix, kind=type(exc).__name__)
        except Exception as exc:
            log.exception("the service's component failed", path=request.url.path)
            return error(500, f"the {name} failed: {type(exc).__name__}: {exc}")

    return answer


def refused(response: Any) -> DataError:
    """The `DataError` a service's 400 reply stands for."""
    from plait_server.engine import error_message

    body = response.json() if response.content else {}
    fix = (body.get("error") or {}).get("fix") if isinstance(body, dict) else None
    return DataError(error_message(response), fix=fix)


def component_factory(
    kind: Any, config_path: Path | None, overrides: tuple[str, ...]
) -> tuple[Callable[[], Any], str]:
    """(a function that builds a new instance of run config's component of `kind`: the trainer or
    inference engine on its model, options and seed; the component's name)."""
    from plait.api import get_registry, load_config, resolve_model

    config = load_config(config_path, overrides)
    section = getattr(config, kind.config_key.split(".")[0])
    name = getattr(section, kind.config_key.split(".")[1])
    if name == "remote":
        raise ConfigError(
            kind.config_key,
            "a service cannot serve the 'remote' component (it would call itself)",
            fix=f"name the component the service runs, e.g. -s {kind.config_key}=torch",
        )
    factory = get_registry().get(kind, name)
    options = factory.validate_options(section.options, f"{kind.config_key.split('.')[0]}.options")
    model = resolve_model(
        config.model.name, tokenizer=config.model.tokenizer, dtype=config.model.dtype
    )
    make = factory.load()
    return (lambda: make(model, options=options, seed=config.run.seed)), name


def serve_until_stopped(
    start: Callable[[], Awaitable[tuple[Any, str, Callable[[], Awaitable[None]]]]],
    *,
    host: str,
    port: int,
    api_key: str | None,
) -> None:
    """`start()` -> (ASGI app, what it serves, an async close); serve the app on host:port until
    SIGINT or SIGTERM, then close. Beyond loopback an API key is required."""
    import click

    from plait.api import configure_logging
    from plait_sdk.server import is_loopback, serving

    if not api_key and not is_loopback(host):
        raise click.UsageError(f"--host {host} serves beyond this machine: give an --api-key first")
    configure_logging("info")

    async def main() -> None:
        app, what, close = await start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            async with serving(app, host, port, name=what) as url:
                click.echo(f"plait {what} on {url}", err=True)
                await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await close()

    asyncio.run(main())


def launch_config(
    directory: Path,
    section: str,
    engine: str,
    engine_options: dict[str, Any],
    *,
    model: Any,
    seed: int,
) -> Path:
    """A run config for a launched service: the model, `[section]` running `engine`, the seed."""
    import tomli_w

    table: dict[str, Any] = {"name": str(model.path), "dtype": model.dtype}
    if model.tokenizer_path and str(model.tokenizer_path) != str(model.path):
        table["tokenizer"] = str(model.tokenizer_path)
    path = directory / f"{section}-service.toml"
    path.write_text(
        tomli_w.dumps(
            {
                "run": {"seed": seed},
                "model": table,
                section: {"engine": engine, "options": dict(engine_options)},
            }
        )
    )
    return path


def start_service(
    name: str,
    command: Callable[[str, int], tuple[list[str], dict[str, str]]],
    *,
    ray: Any,
    host: str,
    port: int | None,
    log_path: str | None,
    files: dict[str, str],
    timeout_s: float,
) -> tuple[Any, str]:
    """(the launched server, its base URL): `command(host, port)` started on this machine, or on
    a Ray node when `ray` (a RayPlacement) is given, with `files` (path -> text) written there."""
    import os
    import tempfile

    from plait_server.engine import ServerProcess, free_port

    if ray is not None:
        from plait_remote.on_ray import RayServer

        server = RayServer(name, ray, command, files=files, timeout_s=timeout_s)
        return server, server.url
    port = port or free_port(host)
    argv, env = command(host, port)
    log_path = log_path or os.path.join(
        tempfile.gettempdir(), f"plait-{name.replace(' ', '-')}-{os.getpid()}-{port}.log"
    )
    return ServerProcess(name, argv, log_path=log_path, env=env), f"http://{host}:{port}"


async def answers_health(url: str) -> bool:
    """Whether the service at `url` answers GET /health with 200 (False while it is not listening
    yet)."""
    import httpx

    try:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            return (await client.get("/health")).status_code == 200
    except httpx.TransportError:
        return False
