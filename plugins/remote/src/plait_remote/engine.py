"""The "remote" inference engine: a `plait serve inference` service, driven over HTTP.

Launched (no `url`), it starts `python -m plait.cli serve inference` on a run config of its own
(the model, `engine` and `engine_options`) and, through `plait_server.engine.ServerEngine`, gets
the same lifecycle as the vLLM and SGLang engines: a start-up deadline, failures named with the
service's log, a client-side pause gate, weights staged on disk, and a service that dies is
launched again with the weights it had while its running requests are sent once more. With
`ray` set, the service starts on a node of a Ray cluster instead (plait_remote.on_ray).
"""

from __future__ import annotations

import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

from plait.api import (
    DataError,
    EngineError,
    ModelInput,
    PauseMode,
    ResolvedModel,
    SampleResponse,
    SamplingParams,
    from_json,
    prompt_token_ids,
    to_json,
)
from plait_remote.options import RemoteOptions
from plait_remote.wire import launch_config, refused
from plait_server.engine import LaunchedServer, ServerEngine


class RemoteEngine(ServerEngine):
    """`plait.protocols.InferenceEngine` (plus `DiskWeightLoader`) on a `plait serve inference`
    service."""

    server_name = "plait inference service"
    options: RemoteOptions

    def __init__(
        self, model: ResolvedModel, *, options: RemoteOptions | None = None, seed: int = 0
    ) -> None:
        options = options or RemoteOptions()
        if options.engine == "remote" and not options.url:
            raise EngineError(
                "inference.options.engine is 'remote': the service would launch itself",
                fix='name the engine the service runs, e.g. inference.options.engine = "torch"',
            )
        if options.ray is not None and not options.api_key:  # a Ray node's address is not loopback
            options = attrs.evolve(options, api_key=secrets.token_urlsafe(24))
        self._config_dir: tempfile.TemporaryDirectory[str] | None = None
        super().__init__(model, options, seed)

    def _config(self) -> Path:
        """The run config the service runs: the model, `engine` with `engine_options`, the seed."""
        if self._config_dir is None:
            self._config_dir = tempfile.TemporaryDirectory(prefix="plait-remote-")
        o = self.options
        return launch_config(
            Path(self._config_dir.name),
            "inference",
            o.engine,
            o.engine_options,
            model=self.model,
            seed=self._launch_seed,
        )

    def _command(self, host: str, port: int) -> tuple[list[str], dict[str, str]]:
        o = self.options
        argv = [
            o.python or sys.executable,
            "-m",
            "plait.cli",
            "serve",
            "inference",
            str(self._config()),
            "--host",
            host,
            "--port",
            str(port),
            *o.server_args,
        ]
        env = {"PLAIT_API_KEY": o.api_key} if o.api_key else {}
        return argv, {**env, **o.env}

    def launch_command(self, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        return self._command(self.options.host, port)

    def start_server(self) -> tuple[LaunchedServer, str]:
        if self.options.ray is None:
            return super().start_server()
        from plait_remote.on_ray import RayServer

        config = self._config()
        server = RayServer(
            self.server_name,
            self.options.ray,
            self._command,
            files={str(config): config.read_text()},
            timeout_s=self.options.startup_timeout_s,
        )
        return server, server.url

    async def _on_ready(self) -> None:
        health = await self.http.json("GET", "/health")
        self._version = int(health["weight_version"])

    async def _status(self) -> str:
        return f"{'paused' if self._gate.paused else 'running'}; {self.http.base_url}"

    async def close(self) -> None:
        await super().close()
        if self._config_dir is not None:
            self._config_dir.cleanup()

    async def _call(
        self, path: str, body: dict[str, Any], *, timeout_s: float | None = None
    ) -> Any:
        """POST `body`; the service's 400 comes back as the `DataError` it was on the other side."""
        response = await self.http.request(
            "POST", path, json=body, timeout_s=timeout_s, accept=(200, 400)
        )
        if response.status_code == 400:
            raise refused(response)
        return response.json()

    # -- sampling -------------------------------------------------------------------------

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        prompt_token_ids(prompt, self.vocab_size)  # a bad prompt fails here, before the wire
        if num_samples < 1:
            raise DataError(f"num_samples must be >= 1, got {num_samples}")
        params = sampling_params
        if params.seed is None:  # a seed per request, so that a request sent again samples the same
            params = attrs.evolve(params, seed=self._seed(None))
        body = {
            "prompt": to_json(prompt),
            "num_samples": num_samples,
            "sampling_params": to_json(params),
        }

        async def send() -> Any:
            return await self._call("/sample", body, timeout_s=self.options.request_timeout_s)

        return from_json(SampleResponse, await self._reissued_after_restart(send, in_flight=True))

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        prompt_token_ids(prompt, self.vocab_size)
        body = {"prompt": to_json(prompt)}

        async def send() -> Any:
            return await self._call(
                "/compute_logprobs", body, timeout_s=self.options.request_timeout_s
            )

        reply = await self._reissued_after_restart(send, in_flight=True)
        return [None if value is None else float(value) for value in reply["logprobs"]]

    # -- pause / resume -------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        await self._ensure_ready()
        self._gate.pause()
        timeout = (
            self.options.request_timeout_s if mode == "wait" else None
        )  # "wait" lasts as long as a request
        await self._call("/pause", {"mode": mode}, timeout_s=timeout)

    async def resume(self) -> None:
        await self._ensure_ready()
        await self._call("/resume", {})
        self._gate.resume()

    # -- weights --------------------------------------------------------------------------

    async def _load_weights_from_disk(self, path: str, version: int) -> None:
        await self._ensure_ready()
        async with self._lock():
            reply = await self._call("/load_weights", {"path": str(path), "version": int(version)})
        self._version = int(reply["weight_version"])

    async def _set_weight_version(self, version: int) -> None:
        await self._ensure_ready()
        async with self._lock():
            reply = await self._call("/weight_version", {"version": int(version)})
        self._version = int(reply["weight_version"])
