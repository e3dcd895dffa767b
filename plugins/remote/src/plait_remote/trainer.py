"""The "remote" trainer engine: a trainer on a `plait serve trainer` service, driven over HTTP.

Launched (no `url`), it starts `python -m plait.cli serve trainer` on a run config of its own
(the model, `engine` and `engine_options`), waits for it to answer, and creates its trainer
there; attached, it creates its trainer on the service at `url`; with `ray` set, the service
starts on a node of a Ray cluster (plait_remote.on_ray). Calls are synchronous, like
every trainer engine's. Exported weights come back through a shared directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from plait.api import (
    AdamParams,
    Datum,
    EngineError,
    ForwardBackwardOutput,
    OptimStepResult,
    ResolvedModel,
    TrainerCapabilities,
    from_json,
    to_json,
)
from plait_remote.options import RemoteTrainerOptions
from plait_remote.wire import answers_health, launch_config, refused, start_service

SERVICE = "plait trainer service"


class RemoteTrainer:
    """`plait.protocols.TrainerEngine` (plus `MeasuresFlops` and
    `plait_weights.capabilities.WritesWeightFiles`) on a `plait serve trainer` service."""

    def __init__(
        self, model: ResolvedModel, *, options: RemoteTrainerOptions | None = None, seed: int = 0
    ) -> None:
        import httpx

        self.model = model
        options = options or RemoteTrainerOptions()
        if options.ray is not None and not options.api_key:  # a Ray node's address is not loopback
            options = attrs.evolve(options, api_key=secrets.token_urlsafe(24))
        self.options = options
        if options.engine == "remote" and not options.url:
            raise EngineError(
                "trainer.options.engine is 'remote': the service would launch itself",
                fix='name the engine the service runs, e.g. trainer.options.engine = "torch"',
            )
        self._scratch = Path(tempfile.mkdtemp(prefix="plait-remote-trainer-"))
        self._exports = (
            Path(options.exchange_dir).expanduser()
            if options.exchange_dir
            else self._scratch / "exports"
        )
        self.server: Any = None
        base_url = options.url or self._launch(seed)
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self._http = httpx.Client(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(options.request_timeout_s, connect=10.0),
        )
        self.base_url = base_url.rstrip("/")
        try:
            created = self._post("/trainers", {})
        except BaseException:
            self._shut_down()
            raise
        self.trainer_id = str(created["id"])
        self._version = int(created["weight_version"])
        self.capabilities = from_json(TrainerCapabilities, created["capabilities"])
        self.peak_flops_per_s: float | None = created.get("peak_flops_per_s")
        self._closed = False

    def _launch(self, seed: int) -> str:

        o = self.options
        config = launch_config(
            self._scratch, "trainer", o.engine, o.engine_options, model=self.model, seed=seed
        )

        def command(host: str, port: int) -> tuple[list[str], dict[str, str]]:
            argv = [
                o.python or sys.executable,
                "-m",
                "plait.cli",
                "serve",
                "trainer",
                str(config),
                "--host",
                host,
                "--port",
                str(port),
            ]
            return argv, {**({"PLAIT_API_KEY": o.api_key} if o.api_key else {}), **o.env}

        self.server, url = start_service(
            SERVICE,
            command,
            ray=o.ray,
            host=o.host,
            port=o.port,
            log_path=o.log_path,
            files={str(config): config.read_text()},
            timeout_s=o.startup_timeout_s,
        )

        # wait_healthy is async and a trainer is built from synchronous code that may run inside
        # an event loop: wait in a thread of its own
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(
                asyncio.run,
                self.server.wait_healthy(
                    lambda: answers_health(url), timeout_s=o.startup_timeout_s
                ),
            ).result()
        return url

    # -- the wire ---------------------------------------------------------------------------

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        import httpx

        from plait_server.engine import error_message

        what = f"{method} {path}"
        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            if self.server is not None and not self.server.alive():
                raise self.server.crash_error(f" (during {what})") from None
            raise EngineError(
                f"cannot reach the {SERVICE} at {self._http.base_url} ({what}): "
                f"{type(exc).__name__}: {exc}",
                fix="start the service, or check trainer.options.url",
            ) from exc
        if response.status_code == 400:
            raise refused(response)
        if response.status_code != 200:
            raise EngineError(
                f"the {SERVICE} answered {what} with HTTP {response.status_code}: "
                f"{error_message(response)}"
            )
        return response.json()

    def _trainer(self, call: str, body: Mapping[str, Any]) -> Any:
        if self._closed:
            raise EngineError("the remote trainer is closed", fix="build a new engine")
        return self._post(f"/trainers/{self.trainer_id}/{call}", body)

    # -- TrainerEngine ----------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def _losses(
        self,
        call: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None,
    ) -> ForwardBackwardOutput:
        body = {
            "data": [to_json(datum) for datum in data],
            "loss_fn": loss_fn,
            "loss_fn_config": dict(loss_fn_config) if loss_fn_config is not None else None,
        }
        return from_json(ForwardBackwardOutput, self._trainer(call, body))

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        return self._losses("forward", data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        return self._losses("forward_backward", data, loss_fn, loss_fn_config)

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        result = from_json(
            OptimStepResult, self._trainer("optim_step", {"adam_params": to_json(adam_params)})
        )
        self._version = result.weight_version
        return result

    def save_state(self, path: str | Path) -> None:
        self._trainer("save_state", {"path": str(Path(path).resolve())})

    def load_state(self, path: str | Path) -> None:
        self._version = int(
            self._trainer("load_state", {"path": str(Path(path).resolve())})["weight_version"]
        )

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        from safetensors.torch import load_file

        directory = self._exports / f"{self.trainer_id}-v{self._version}"
        try:
            tensors = load_file(self.export_weights_to(directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        yield from tensors.items()

    def export_weights_to(self, directory: Path) -> Path:
        """The service writes `directory/model.safetensors`
        (`plait_weights.capabilities.WritesWeightFiles`: the disk sync has it written where the
        engines load it). `directory` must be writable by the service."""
        return Path(
            self._trainer("export_weights", {"path": str(Path(directory).resolve())})["path"]
        )

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            with contextlib.suppress(EngineError):  # a service that is gone holds nothing
                self._request("DELETE", f"/trainers/{self.trainer_id}")
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        if getattr(self, "_http", None) is not None:
            self._http.close()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self._scratch, ignore_errors=True)
