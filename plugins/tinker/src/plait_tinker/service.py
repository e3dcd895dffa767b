"""The Tinker service behind `plait serve tinker`, apart from HTTP: sessions, training runs (each
a LoRA adapter on a base model shared by every run of that model), sampling sessions,
checkpoints and futures, for one or many tenants.

Training runs on one worker thread: each run executes its requests one at a time in `seq_id`
order (the SDK sends a forward_backward's chunks concurrently, the first one last) and the runs
take turns on the thread in the order their requests become ready, so one tenant's long queue
cannot starve another's. Sampling runs on inference engines (one per sampled checkpoint, the
least recently used closed beyond `server.max_samplers`), concurrently with training.

Every object belongs to the tenant that made it; another tenant's ids are answered as unknown.
A failed request fails its own future (an error body the SDK raises), nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import attrs
import structlog

from plait.api import (
    INFERENCE_ENGINE,
    TRAINER_ENGINE,
    AdamParams,
    AdapterEngine,
    AdapterTrainer,
    InferenceEngine,
    LoraConfig,
    ResolvedModel,
    TrainerEngine,
    build,
    resolve_model,
)
from plait_tinker import wire
from plait_tinker.batcher import TrainingBatcher
from plait_tinker.config import Tenant, TinkerServerConfig
from plait_tinker.errors import ServiceError, not_found, quota_exceeded
from plait_tinker.futures import Futures, Sequencer

log = structlog.get_logger("plait_tinker")
T = TypeVar("T")

OPEN_TENANT = Tenant(name="local", api_key="")
EPHEMERAL_KEPT = 4  # a run's snapshots for sampling kept on disk (older ones are deleted)
SNAPSHOT_PREFIX = (
    "snapshot-"  # sampler weights saved for a sampling client alone, not listed as checkpoints
)


def training_run_id(session_id: str, body: dict[str, Any]) -> str:
    """The id the SDK assumes for a session's n-th training client (create-via-load relies on
    it)."""
    return f"{session_id}:train:{int(body.get('model_seq_id', 0))}"


def sampling_session_id(session_id: str, body: dict[str, Any]) -> str:
    return f"{session_id}:sample:{int(body.get('sampling_session_seq_id', 0))}"


@attrs.define
class Session:
    id: str
    tenant: str
    last_seen: float
    finished: bool = False


@attrs.define
class TrainingRun:
    model_id: str
    tenant: str
    session_id: str
    base_model: str
    lora: LoraConfig
    engine: AdapterEngine | None
    user_metadata: dict[str, str]
    created: float
    last_request: float
    sequencer: Sequencer
    ephemeral: collections.deque[Path] = attrs.field(factory=collections.deque)

    def record(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "tenant": self.tenant,
            "base_model": self.base_model,
            "lora": attrs.asdict(self.lora),
            "user_metadata": self.user_metadata,
            "created": self.created,
        }


@attrs.define
class Sampler:
    id: str
    tenant: str
    base_model: str
    weights: Path | None  # a saved adapter, None for the base model
    model_path: str | None  # its tinker:// path, when it has one
    session: str = ""
    busy: int = 0  # sample requests in flight
    last_used: float = attrs.field(factory=time.monotonic)


@attrs.define
class _SamplingEngine:
    engine: InferenceEngine
    users: int = 0


class TinkerService:
    def __init__(self, config: TinkerServerConfig, storage: Path) -> None:
        self.config = config
        self.storage = storage
        storage.mkdir(parents=True, exist_ok=True)
        self.tenants = {t.api_key: t for t in config.tenants}
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, TrainingRun] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures = Futures(config.server.abandon_s, self._suspect_dead)
        self._opening: dict[str, set[str]] = collections.defaultdict(set)  # tenant: model ids
        self._models: dict[str, ResolvedModel] = {}
        self._hosts: dict[str, TrainerEngine] = {}
        self.batchers: dict[str, TrainingBatcher] = {}
        self._engines: collections.OrderedDict[tuple[str, Path | None], _SamplingEngine] = (
            collections.OrderedDict()
        )
        self._engine_lock = asyncio.Lock()
        self._trainer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-trainer")
        self._session_ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()
        self._sample_ids = itertools.count(1)

    # -- tenants and ids -----------------------------------------------------------------------

    def tenant(self, api_key: str | None) -> Tenant:
        if not self.tenants:
            return OPEN_TENANT
        tenant = self.tenants.get(api_key or "")
        if tenant is None:
            raise ServiceError("unknown API key", status=401)
        return tenant

    def session(self, tenant: Tenant, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant.name:
            raise not_found(f"session {session_id!r}")
        if session.finished:
            raise ServiceError(f"session {session_id!r} has finished", status=410)
        session.last_seen = time.monotonic()
        return session

    def touch(self, session_id: str) -> None:
        """The session's client is alive: it sent a request."""
        if session_id in self.sessions:
            self.sessions[session_id].last_seen = time.monotonic()

    def run(self, tenant: Tenant, model_id: str) -> TrainingRun:
        run = self.runs.get(model_id)
        if run is None or run.tenant != tenant.name:
            raise not_found(f"training run {model_id!r}")
        if run.engine is None:
            raise ServiceError(
                f"training run {model_id!r} is not loaded (its session finished)",
                status=410,
                category="user",
            )
        run.last_request = time.time()
        self.touch(run.session_id)
        return run

    def base_model(self, name: str | None) -> str:
        if name not in self.config.models:
            raise ServiceError(
                f"base model {name!r} is not served here; served: {', '.join(self.config.models)}"
            )
        return name

    # -- sessions ------------------------------------------------------------------------------

    def create_session(self, tenant: Tenant) -> str:
        session_id = f"session-{next(self._session_ids)}-{int(time.time())}"
        self.sessions[session_id] = Session(session_id, tenant.name, time.monotonic())
        return session_id

    async def finish_session(self, tenant: Tenant, session_id: str) -> None:
        await self._finish(self.session(tenant, session_id))

    async def finish_stale_sessions(self) -> None:
        """Finish the sessions whose client stopped sending heartbeats, unloading their runs."""
        cutoff = time.monotonic() - self.config.server.session_timeout_s
        for session in list(self.sessions.values()):
            if not session.finished and session.last_seen < cutoff:
                log.info("session timed out; unloading its runs", session=session.id)
                await self._finish(session)

    def tenant_sessions(self, tenant: Tenant) -> list[Session]:
        return [s for s in self.sessions.values() if s.tenant == tenant.name]

    def session_contents(self, tenant: Tenant, session_id: str) -> dict[str, list[str]]:
        """A session's training runs and sampling clients (finished sessions keep their runs)."""
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant.name:
            raise not_found(f"session {session_id!r}")
        return {
            "training_run_ids": [
                r.model_id for r in self.runs.values() if r.session_id == session_id
            ],
            "sampler_ids": [s.id for s in self.samplers.values() if s.session == session_id],
        }

    def _suspect_dead(self, session_id: str) -> None:
        """A request of the session was abandoned: if its client sends nothing more (a live SDK
        heartbeats every 10 s), it died; finish the session without waiting for the timeout."""
        since = time.monotonic()

        async def check() -> None:
            await asyncio.sleep(self.config.server.dead_after_s)
            session = self.sessions.get(session_id)
            if session is not None and not session.finished and session.last_seen < since:
                log.info("the session's client died; finishing it", session=session_id)
                await self._finish(session)

        task = asyncio.create_task(check())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish(self, session: Session) -> None:
        """Cancel the session's work, unload its runs and release its sampling clients."""
        session.finished = True
        self.futures.cancel_session(session.id)
        for sampler in [s for s in self.samplers.values() if s.session == session.id]:
            del self.samplers[sampler.id]
        await self._unload([run for run in self.runs.values() if run.session_id == session.id])

    async def unload(self, run: TrainingRun) -> None:
        await self._unload([run])

    async def _unload(self, runs: list[TrainingRun]) -> None:
        for run in runs:
            engine, run.engine = run.engine, None
            if engine is not None:
                async with run.sequencer.turn(run.sequencer.next_seq):  # after what it has queued
                    await self._train(engine.close)

    # -- training ------------------------------------------------------------------------------

    async def _train(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._trainer, fn, *args)

    async def _host(self, base_model: str) -> AdapterTrainer:
        if base_model not in self._hosts:
            self._hosts[base_model] = await self._train(self._build_trainer, base_model)
        host = self._hosts[base_model]
        if not isinstance(host, AdapterTrainer):
            raise ServiceError(
                f"trainer engine {self.config.trainer.engine!r} cannot open LoRA adapters "
                "(plait.protocols.AdapterTrainer); serve with one that can, e.g. 'torch'",
                category="server",
                status=500,
            )
        if base_model not in self.batchers:
            self.batchers[base_model] = TrainingBatcher(host, self._train)
        return host

    def tokenizer_path(self, base_model: str) -> str:
        """The served model's tokenizer directory: what `get_tokenizer` loads, offline, on the
        server's machine."""
        return str(self._model(base_model).tokenizer_path)

    def _model(self, base_model: str) -> ResolvedModel:
        if base_model not in self._models:
            spec = self.config.models[base_model]
            self._models[base_model] = resolve_model(spec.model)
        return self._models[base_model]

    def _build_trainer(self, base_model: str) -> TrainerEngine:
        log.info("loading base model for training", base_model=base_model)
        return build(
            TRAINER_ENGINE,
            self.config.trainer.engine,
            self._model(base_model),
            options=self.config.trainer.options,
            options_path="trainer.options",
            seed=0,
        )

    def limit(self, tenant: Tenant, quota: str) -> int:
        """The tenant's `max_training_runs` or `max_sampling_sessions` (server's by default)."""
        value = getattr(tenant, quota)
        return int(value if value is not None else getattr(self.config.server, quota))

    def _admit_run(self, tenant: Tenant, model_id: str) -> None:
        """Count a new run against the tenant's quota now, before it loads (no await in
        between), so that concurrent creates cannot pass it."""
        opening = self._opening[tenant.name]
        if model_id in opening or model_id in self.runs:
            return  # a resubmitted create: it counts once
        loaded = sum(
            1 for r in self.runs.values() if r.tenant == tenant.name and r.engine is not None
        )
        limit = self.limit(tenant, "max_training_runs")
        if loaded + len(opening) >= limit:
            raise quota_exceeded(
                f"tenant {tenant.name!r} holds {loaded + len(opening)} training runs, its "
                f"quota (max_training_runs = {limit}); close a ServiceClient (or unload a run) "
                "to free one"
            )
        opening.add(model_id)

    def create_model(self, tenant: Tenant, body: dict[str, Any]) -> tuple[str, str]:
        """A future of the new run, and its id."""
        session = self.session(tenant, str(body.get("session_id")))
        base = self.base_model(body.get("base_model"))
        lora = _lora_config(body.get("lora_config") or {}, self.config.server.lora_alpha)
        model_id = training_run_id(session.id, body)
        self._admit_run(tenant, model_id)
        return self.futures.submit(
            tenant.name,
            session.id,
            self._open_run(
                tenant,
                session,
                model_id,
                base,
                lora,
                body.get("user_metadata") or {},
                seed=int((body.get("lora_config") or {}).get("seed") or 0),
            ),
            key=("create", model_id),
        ), model_id

    async def _open_run(
        self,
        tenant: Tenant,
        session: Session,
        model_id: str,
        base: str,
        lora: LoraConfig,
        user_metadata: dict[str, str],
        seed: int,
        state: Path | None = None,
        optimizer: bool = True,
    ) -> dict[str, Any]:
        try:
            return await self._load_run(
                tenant, session, model_id, base, lora, user_metadata, seed, state, optimizer
            )
        finally:
            self._opening[tenant.name].discard(model_id)

    async def _load_run(
        self,
        tenant: Tenant,
        session: Session,
        model_id: str,
        base: str,
        lora: LoraConfig,
        user_metadata: dict[str, str],
        seed: int,
        state: Path | None,
        optimizer: bool,
    ) -> dict[str, Any]:
        if model_id in self.runs:
            raise ServiceError(f"training run {model_id!r} exists already")
        host = await self._host(base)
        engine = await self._train(host.open_adapter, model_id, lora, seed)
        try:
            if state is not None:
                await self._train(engine.load_state, state, optimizer)
            if session.finished:
                raise ServiceError(
                    f"session {session.id!r} finished while its run loaded", status=410
                )
        except BaseException:
            await self._train(engine.close)
            raise
        run = TrainingRun(
            model_id,
            tenant.name,
            session.id,
            base,
            lora,
            engine,
            dict(user_metadata),
            time.time(),
            time.time(),
            Sequencer(),
        )
        self.runs[model_id] = run
        self._write_record(run)
        log.info(
            "training run created",
            model_id=model_id,
            tenant=tenant.name,
            base_model=base,
            rank=lora.rank,
            from_state=str(state) if state else None,
        )
        return {"model_id": model_id, "type": "create_model"}

    def _write_record(self, run: TrainingRun) -> None:
        directory = self.storage / run.model_id
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "run.json").write_text(json.dumps(run.record(), indent=1))

    @contextlib.contextmanager
    def _settles_on_refusal(self, tenant: Tenant, model_id: str, seq_id: int) -> Iterator[None]:
        """A request refused before it is queued still settles its place in the run's order, so
        the run's next request does not wait for it."""
        try:
            yield
        except Exception:
            self.settle(tenant, model_id, seq_id)
            raise

    def settle(self, tenant: Tenant, model_id: str, seq_id: int) -> None:
        """A request of the run was refused: its seq_id takes no turn."""
        run = self.runs.get(model_id)
        if run is not None and run.tenant == tenant.name:
            run.sequencer.settle(seq_id)

    def in_order(
        self,
        tenant: Tenant,
        model_id: str,
        seq_id: int,
        kind: str,
        work: Callable[[TrainingRun], Awaitable[Any]],
    ) -> str:
        """Submit `work` to run in the run's seq_id order; a resubmit gets the first id."""
        run = self.run(tenant, model_id)

        async def ordered() -> Any:
            async with run.sequencer.turn(seq_id):
                if run.engine is None:
                    raise ServiceError(f"training run {model_id!r} was unloaded", status=410)
                return await work(run)

        return self.futures.submit(
            tenant.name, run.session_id, ordered(), key=(model_id, seq_id, kind)
        )

    def forward_backward(self, tenant: Tenant, call: wire.ForwardBackwardCall) -> str:
        with self._settles_on_refusal(tenant, call.model_id, call.seq_id):
            return self.in_order(
                tenant, call.model_id, call.seq_id, "forward_backward", self._forward_backward(call)
            )

    def _forward_backward(
        self, call: wire.ForwardBackwardCall
    ) -> Callable[[TrainingRun], Awaitable[bytes]]:
        async def work(run: TrainingRun) -> bytes:
            assert run.engine is not None
            if call.forward_only:
                output = await self._train(
                    run.engine.forward, call.data, call.loss_fn, call.loss_fn_config
                )
            else:
                output = await self.batchers[run.base_model].forward_backward(run.engine, call)
            return wire.write_forward_backward(output)

        return work

    def optim_step(self, tenant: Tenant, body: dict[str, Any]) -> str:
        model_id, seq_id = str(body.get("model_id")), int(body.get("seq_id", 0))
        with self._settles_on_refusal(tenant, model_id, seq_id):
            params = _adam_params(body.get("adam_params"))
            return self.in_order(tenant, model_id, seq_id, "optim_step", self._optim_step(params))

    def _optim_step(self, params: AdamParams) -> Callable[[TrainingRun], Awaitable[Any]]:

        async def work(run: TrainingRun) -> dict[str, Any]:
            assert run.engine is not None
            result = await self.batchers[run.base_model].optim_step(run.engine, params)
            return {
                "metrics": {wire.metric_key(k): float(v) for k, v in result.metrics.items()},
                "type": "optim_step",
            }

        return work

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ServiceError(
                f"checkpoint name {name!r}: use a plain name (no '/', not starting with '.')"
            )
        return self.storage / model_id / kind / name

    def resolve_path(
        self, tenant: Tenant, tinker_path: str, published: bool = False
    ) -> tuple[TrainingRunRecord, str, Path]:
        """A `tinker://<model_id>/<weights|sampler_weights>/<name>` path of this tenant's, or
        with `published`, one another tenant published (to load or sample from, not to change)."""
        parts = (
            tinker_path.removeprefix("tinker://").split("/")
            if tinker_path.startswith("tinker://")
            else []
        )
        if (
            len(parts) != 3
            or parts[1] not in ("weights", "sampler_weights")
            or any(not part or part.startswith(".") for part in parts)
        ):
            raise ServiceError(
                f"{tinker_path!r} is not a tinker://<run>/<weights|sampler_weights>/<name> path"
            )
        directory = self.storage / parts[0] / parts[1] / parts[2]
        meta = _checkpoint_meta(directory)
        try:
            record = self.record(tenant, parts[0])
        except ServiceError:
            if not (published and meta and meta.get("public")):
                raise
            record = TrainingRunRecord(
                json.loads((self.storage / parts[0] / "run.json").read_text()),
                self.storage / parts[0],
            )
        if meta is None:
            raise not_found(f"checkpoint {tinker_path!r}")
        return record, parts[1], directory

    def update_checkpoint(
        self, tenant: Tenant, model_id: str, kind: str, name: str, **changes: Any
    ) -> None:
        """Set `public` or `expires_at` of one of this tenant's checkpoints."""
        _, _, directory = self.resolve_path(tenant, f"tinker://{model_id}/{kind}/{name}")
        meta = _checkpoint_meta(directory) or {}
        (directory / "checkpoint.json").write_text(json.dumps({**meta, **changes}))

    async def expire_checkpoints(self) -> None:
        """Delete the checkpoints whose ttl has passed."""
        now = time.time()
        for path in self.storage.glob("*/*/*/checkpoint.json"):
            meta = _checkpoint_meta(path.parent)
            if meta and meta.get("expires_at") and meta["expires_at"] < now:
                log.info("checkpoint expired; deleting it", path=meta.get("tinker_path"))
                await self._forget_weights(path.parent)

    def record(self, tenant: Tenant, model_id: str) -> TrainingRunRecord:
        path = self.storage / model_id / "run.json"
        data = json.loads(path.read_text()) if path.is_file() and "/" not in model_id else None
        if data is None or data["tenant"] != tenant.name:
            raise not_found(f"training run {model_id!r}")
        return TrainingRunRecord(data, self.storage / model_id)

    async def _save(self, run: TrainingRun, kind: str, name: str, ttl_seconds: Any = None) -> Path:
        assert run.engine is not None
        directory = self.checkpoint_dir(run.model_id, kind, name)
        await self._train(run.engine.save_state, directory)
        expires = time.time() + float(ttl_seconds) if ttl_seconds else None
        (directory / "checkpoint.json").write_text(
            json.dumps(
                {
                    "checkpoint_id": f"{kind}/{name}",
                    "checkpoint_type": "training" if kind == "weights" else "sampler",
                    "time": time.time(),
                    "expires_at": expires,
                    "tinker_path": f"tinker://{run.model_id}/{kind}/{name}",
                }
            )
        )
        return directory

    def save_weights(self, tenant: Tenant, body: dict[str, Any]) -> str:
        with self._settles_on_refusal(
            tenant, str(body.get("model_id")), int(body.get("seq_id", 0))
        ):
            name = str(body.get("path") or "")
            model_id = str(body.get("model_id"))
            self.checkpoint_dir(model_id, "weights", name)

            async def work(run: TrainingRun) -> dict[str, Any]:
                directory = self.checkpoint_dir(run.model_id, "weights", name)
                if directory.exists() and not body.get("overwrite"):
                    raise ServiceError(
                        f"checkpoint tinker://{run.model_id}/weights/{name} exists; "
                        "pick another name",
                        status=409,
                    )
                await self._save(run, "weights", name, body.get("ttl_seconds"))
                return {"path": f"tinker://{run.model_id}/weights/{name}", "type": "save_weights"}

            return self.in_order(tenant, model_id, int(body.get("seq_id", 0)), "save_weights", work)

    def save_weights_for_sampler(self, tenant: Tenant, body: dict[str, Any]) -> str:
        with self._settles_on_refusal(
            tenant, str(body.get("model_id")), int(body.get("seq_id", 0))
        ):
            model_id = str(body.get("model_id"))
            name = body.get("path")
            if name is not None:
                self.checkpoint_dir(model_id, "sampler_weights", str(name))

            async def work(run: TrainingRun) -> dict[str, Any]:
                if name is not None:
                    await self._save(run, "sampler_weights", str(name), body.get("ttl_seconds"))
                    return {
                        "path": f"tinker://{run.model_id}/sampler_weights/{name}",
                        "type": "save_weights_for_sampler",
                    }
                # A snapshot for a sampling client and nothing else: kept while recent.
                snapshot = sampling_session_id(run.session_id, body)
                directory = await self._save(
                    run, "sampler_weights", f"{SNAPSHOT_PREFIX}{run.sequencer.next_seq}"
                )
                run.ephemeral.append(directory)
                while len(run.ephemeral) > EPHEMERAL_KEPT:
                    await self._forget_weights(run.ephemeral.popleft())
                self._hold_sampler(
                    tenant,
                    Sampler(snapshot, run.tenant, run.base_model, directory, None, run.session_id),
                )
                return {"sampling_session_id": snapshot, "type": "save_weights_for_sampler"}

            return self.in_order(
                tenant, model_id, int(body.get("seq_id", 0)), "save_weights_for_sampler", work
            )

    async def _forget_weights(self, directory: Path) -> None:
        async with self._engine_lock:
            for key in [
                key
                for key, entry in self._engines.items()
                if key[1] == directory and entry.users == 0
            ]:
                await self._engines.pop(key).engine.close()
        for sampler in [s for s in self.samplers.values() if s.weights == directory]:
            del self.samplers[sampler.id]  # a snapshot's sampler goes with its weights
        shutil.rmtree(directory, ignore_errors=True)

    def load_weights(self, tenant: Tenant, body: dict[str, Any]) -> tuple[str, str | None]:
        """Into an existing run (`model_id`), or a new run made from the checkpoint (`session_id`
        + `model_seq_id`, "create-via-load"): a future, and the new run's id."""
        with self._settles_on_refusal(
            tenant, str(body.get("model_id")), int(body.get("seq_id", 0))
        ):
            record, kind, directory = self.resolve_path(
                tenant, str(body.get("path")), published=True
            )
            if kind != "weights":
                raise ServiceError(
                    f"{body.get('path')!r} holds sampler weights; load a state saved by save_state"
                )
            optimizer = bool(body.get("optimizer"))
            if body.get("model_id"):

                async def work(run: TrainingRun) -> dict[str, Any]:
                    assert run.engine is not None
                    await self._train(run.engine.load_state, directory, optimizer)
                    return {"path": body["path"], "type": "load_weights"}

                return self.in_order(
                    tenant, str(body["model_id"]), int(body.get("seq_id", 0)), "load_weights", work
                ), None
            session = self.session(tenant, str(body.get("session_id")))
            model_id = training_run_id(session.id, body)
            base = self.base_model(body.get("base_model") or record.data["base_model"])
            self._admit_run(tenant, model_id)

            async def create() -> dict[str, Any]:
                await self._open_run(
                    tenant,
                    session,
                    model_id,
                    base,
                    LoraConfig(**record.data["lora"]),
                    body.get("user_metadata") or record.data["user_metadata"],
                    seed=0,
                    state=directory,
                    optimizer=optimizer,
                )
                return {"model_id": model_id, "path": body["path"], "type": "load_weights"}

            return self.futures.submit(
                tenant.name, session.id, create(), key=("create", model_id)
            ), model_id

    async def delete_checkpoint(self, tenant: Tenant, model_id: str, kind: str, name: str) -> None:
        _, _, directory = self.resolve_path(tenant, f"tinker://{model_id}/{kind}/{name}")
        await self._forget_weights(directory)

    # -- sampling ------------------------------------------------------------------------------

    def create_sampling_session(self, tenant: Tenant, body: dict[str, Any]) -> str:
        session = self.session(tenant, str(body.get("session_id")))
        sampler = self._sampler_of(tenant, sampling_session_id(session.id, body), body)
        sampler.session = session.id
        self._hold_sampler(tenant, sampler)
        return sampler.id

    def _hold_sampler(self, tenant: Tenant, sampler: Sampler) -> None:
        """Hold a new sampling client; at the tenant's max_sampling_sessions, release its least
        recently used idle one (the SDK never says when a sampling client is dropped)."""
        held = [s for s in self.samplers.values() if s.tenant == tenant.name]
        limit = self.limit(tenant, "max_sampling_sessions")
        if len(held) >= limit:
            idle = [s for s in held if s.busy == 0]
            if not idle:
                raise quota_exceeded(
                    f"tenant {tenant.name!r} has {len(held)} sampling clients sampling, its quota "
                    f"(max_sampling_sessions = {limit}); wait for their samples"
                )
            released = min(idle, key=lambda s: s.last_used)
            del self.samplers[released.id]
            log.info("released an idle sampling client", sampler=released.id, tenant=tenant.name)
        self.samplers[sampler.id] = sampler

    def _sampler_of(self, tenant: Tenant, sampler_id: str, body: dict[str, Any]) -> Sampler:
        """A sampler of the checkpoint `body["model_path"]`, else of the base model
        `body["base_model"]`."""
        if body.get("model_path"):
            record, _, directory = self.resolve_path(
                tenant, str(body["model_path"]), published=True
            )
            return Sampler(
                sampler_id, tenant.name, record.data["base_model"], directory, body["model_path"]
            )
        return Sampler(sampler_id, tenant.name, self.base_model(body.get("base_model")), None, None)

    def sampler(self, tenant: Tenant, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant.name:
            raise ServiceError(
                f"sampler {sampler_id!r} not found: it was released when its session finished, "
                "or for a newer one at the tenant's max_sampling_sessions; create a new "
                "sampling client",
                status=404,
            )
        sampler.last_used = time.monotonic()
        self.touch(sampler.session)
        return sampler

    def sample(self, tenant: Tenant, body: dict[str, Any]) -> tuple[str, list[str]]:
        """A future of the proto SampleResponse, and an id per sample."""
        if body.get("sampling_session_id"):
            sampler = self.sampler(tenant, str(body["sampling_session_id"]))
        else:  # the pre-session form: a base model or a checkpoint path on the request itself
            sampler = self._sampler_of(tenant, "", body)
        prompt = wire.model_input(body.get("prompt") or {})
        params = wire.sampling_params(body.get("sampling_params") or {})
        num_samples = int(body.get("num_samples", 1))
        if num_samples < 1:
            raise ServiceError(f"num_samples must be >= 1, got {num_samples}")
        for unsupported in (
            "topk_prompt_logprobs",
            "prompt_alt_tokens_k",
            "target_prompt_logprobs",
        ):
            if body.get(unsupported):
                raise ServiceError(
                    f"{unsupported} is not served by plait (its engines return the prompt's "
                    "logprobs of its own tokens only)"
                )
        top_k = body.get("topk_sample_logprobs") or 0
        if not isinstance(top_k, int) or top_k < 0:
            raise ServiceError(f"topk_sample_logprobs must be an integer >= 0, got {top_k!r}")
        params = attrs.evolve(params, top_logprobs=top_k)
        want_prompt_logprobs = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and not (
            want_prompt_logprobs and isinstance(last_n, int) and 1 <= last_n <= prompt.length
        ):
            raise ServiceError(
                f"prompt_logprobs_last_n must be in 1..{prompt.length} (the prompt's length) "
                f"with prompt_logprobs set, got {last_n!r}"
            )

        async def work() -> bytes:
            sampler.busy += 1
            try:
                async with self._engine(sampler) as engine:
                    response = await engine.sample(prompt, num_samples, params)
                    if top_k and any(seq.top_logprobs is None for seq in response.sequences):
                        raise ServiceError(
                            f"topk_sample_logprobs: inference engine "
                            f"{self.config.inference.engine!r} does not return top-k logprobs; "
                            "serve with one that does (torch, vllm, sglang)"
                        )
                    logprobs = (
                        await engine.compute_logprobs(prompt) if want_prompt_logprobs else None
                    )
                    if logprobs is not None and last_n is not None:
                        cut = len(logprobs) - last_n
                        logprobs = [None if i < cut else v for i, v in enumerate(logprobs)]
            finally:
                sampler.busy -= 1
            return wire.write_sample(response, logprobs, top_k)

        request_id = self.futures.submit(tenant.name, sampler.session, work())
        number = next(self._sample_ids)
        return request_id, [f"{sampler.id or 'sample'}:{number}:{i}" for i in range(num_samples)]

    @contextlib.asynccontextmanager
    async def _engine(self, sampler: Sampler) -> AsyncIterator[InferenceEngine]:
        key = (sampler.base_model, sampler.weights)
        async with self._engine_lock:
            entry = self._engines.get(key)
            if entry is None:
                if sampler.weights is not None and not sampler.weights.is_dir():
                    raise ServiceError(
                        f"the weights of sampler {sampler.id!r} were deleted", status=410
                    )
                engine = await asyncio.to_thread(self._build_engine, sampler)
                entry = self._engines[key] = _SamplingEngine(engine)
                await self._close_unused_engines(keep=key)
            self._engines.move_to_end(key)
            entry.users += 1
        try:
            yield entry.engine
        finally:
            entry.users -= 1

    def _build_engine(self, sampler: Sampler) -> InferenceEngine:
        options = dict(self.config.inference.options)
        if sampler.weights is not None:
            options["adapter"] = str(sampler.weights)
        log.info(
            "loading a sampling engine", base_model=sampler.base_model, weights=str(sampler.weights)
        )
        return build(
            INFERENCE_ENGINE,
            self.config.inference.engine,
            self._model(sampler.base_model),
            options=options,
            options_path="inference.options",
            seed=0,
        )

    async def _close_unused_engines(self, keep: tuple[str, Path | None]) -> None:
        for key in [k for k, e in self._engines.items() if k != keep and e.users == 0]:
            if len(self._engines) <= self.config.server.max_samplers:
                break
            await self._engines.pop(key).engine.close()

    # -- what REST lists -----------------------------------------------------------------------

    def training_runs(self, tenant: Tenant) -> list[TrainingRunRecord]:
        records = []
        for path in sorted(self.storage.glob("*/run.json")):
            data = json.loads(path.read_text())
            if data["tenant"] == tenant.name:
                records.append(TrainingRunRecord(data, path.parent))
        return records

    async def close(self) -> None:
        await self._unload(list(self.runs.values()))
        for entry in self._engines.values():
            await entry.engine.close()
        self._engines.clear()
        for host in self._hosts.values():
            await self._train(host.close)
        self._trainer.shutdown(wait=True)


@attrs.frozen
class TrainingRunRecord:
    """A training run as saved on disk (it outlives the process and the loaded adapter)."""

    data: dict[str, Any]
    directory: Path

    def checkpoints(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.directory.glob("*/*/checkpoint.json")):
            meta = json.loads(path.read_text())
            if not path.parent.name.startswith(SNAPSHOT_PREFIX):
                found.append(meta)
        return found


def _checkpoint_meta(directory: Path) -> dict[str, Any] | None:
    """A checkpoint's `checkpoint.json`, None when there is no such checkpoint."""
    path = directory / "checkpoint.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _lora_config(body: dict[str, Any], alpha: float) -> LoraConfig:
    try:
        config = LoraConfig(
            rank=int(body.get("rank", 32)),
            alpha=alpha,
            train_attn=bool(body.get("train_attn", True)),
            train_mlp=bool(body.get("train_mlp", True)),
            train_unembed=bool(body.get("train_unembed", True)),
        )
    except (TypeError, ValueError) as exc:
        raise ServiceError(f"lora_config: {exc}") from None
    if config.rank < 1 or not (config.train_attn or config.train_mlp or config.train_unembed):
        raise ServiceError(
            f"lora_config: rank {config.rank} with train_attn, train_mlp and train_unembed "
            f"{config.train_attn}, {config.train_mlp}, {config.train_unembed} adapts nothing"
        )
    return config


def _adam_params(body: Any) -> AdamParams:
    if not isinstance(body, dict):
        raise ServiceError("optim_step: adam_params is required (this server steps AdamW)")
    fields = {
        k: float(body[k])
        for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        if body.get(k) is not None
    }
    if fields.get("learning_rate", 0.0) < 0:
        raise ServiceError(f"adam_params.learning_rate must be >= 0, got {fields['learning_rate']}")
    try:
        return AdamParams(**fields)
    except (TypeError, ValueError) as exc:
        raise ServiceError(f"adam_params: {exc}") from None
