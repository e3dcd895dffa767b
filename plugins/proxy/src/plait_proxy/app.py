"""The proxy's HTTP face: OpenAI Chat Completions and Responses, Anthropic Messages, models and
sessions, as one ASGI app (Starlette), served by uvicorn in the engine's own event loop.

A request belongs to the session named, in this order, by the path (`/s/<id>/v1/...`), the
`X-Plait-Session` header, or the API key (`Authorization: Bearer <id>` or `x-api-key`), so that a
harness that only lets you set a base URL and a key can still be told which episode it is in.
With `api_key` set the key authenticates instead (every route), and sessions come from the path
or header. A request for a model not served (its name or `served_model_names`) is a 404.

Streaming answers are written once the engine has sampled the whole completion: the engine
contract returns whole sequences. A client that disconnects before then cancels its sampling,
and the call is not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plait.api import DataError
from plait_proxy import anthropic_messages, openai_chat, openai_common, openai_responses
from plait_proxy.chat import ChatRequest, Completion, RequestError
from plait_proxy.proxy import Proxy
from plait_proxy.store import ProxySession, RolloutStore
from plait_sdk.server import parse_json, serving

log = structlog.get_logger("plait.proxy")


class WireFormat(Protocol):
    """What each API module provides (see `plait_proxy.openai_chat`)."""

    def parse_request(self, body: Any) -> ChatRequest: ...

    def response_body(self, request: ChatRequest, completion: Completion) -> dict[str, Any]: ...

    def stream_events(self, request: ChatRequest, completion: Completion) -> Iterator[bytes]: ...

    def error_body(self, error: RequestError) -> dict[str, Any]: ...


APIS: dict[str, WireFormat] = {
    "chat/completions": openai_chat,
    "responses": openai_responses,
    "messages": anthropic_messages,
}


NO_RETRY = {"x-should-retry": "false"}  # honoured by the openai and anthropic SDKs


@attrs.frozen(kw_only=True)
class ProxyOptions:
    """`[serve.proxy]` of the run config (`plait serve proxy`)."""

    served_model_names: tuple[str, ...] = ()
    """More names clients may call the served model by (`--served-model-name` replaces them)."""


@attrs.frozen
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, every request must carry it; sessions then come from the path or the header."""
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    session_per_request: bool = False
    """A request that names no session gets one of its own, gone once it is answered (live
    traffic: every response its own trajectory)."""
    served_model_names: tuple[str, ...] = attrs.field(default=(), converter=tuple[str, ...])
    """More names clients may call the served model by; any other model is a 404."""
    any_model: bool = False
    """Answer whatever model a request names (agent programs run as written, whatever model
    they were written for)."""


class CompletionObserver(Protocol):
    """Told of every answered call before the client sees it (`plait serve online` records it).
    What it returns travels with the answer: `x-plait-<key>` headers, and a `plait` object in
    the body of answers that are not streamed. Raising keeps the answer from the client: a
    RequestError is the client's answer, anything else a 503."""

    def admit(self, headers: Mapping[str, str]) -> None:
        """Before sampling: raise a RequestError to refuse the request."""

    async def completed(
        self, session: ProxySession, completion: Completion, headers: Mapping[str, str]
    ) -> dict[str, Any]: ...


class ProxyApp:
    def __init__(
        self,
        proxy: Proxy,
        store: RolloutStore,
        options: ServeOptions | None = None,
        *,
        observer: CompletionObserver | None = None,
        routes: Sequence[Route] = (),
    ) -> None:
        """`routes`: more endpoints (behind the API key; a RequestError they raise is the
        answer)."""
        self.proxy = proxy
        self.store = store
        self.options = options or ServeOptions()
        self.observer = observer
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/sessions", self.open_session, methods=["POST"]),
            Route("/sessions", self.list_sessions, methods=["GET"]),
            Route("/sessions/{session}", self.show_session, methods=["GET"]),
            Route("/sessions/{session}", self.discard_session, methods=["DELETE"]),
            Route("/sessions/{session}/finish", self.finish_session, methods=["POST"]),
            *(Route(r.path, self._guarded(r.endpoint), methods=r.methods) for r in routes),
        ]
        for prefix in ("", "/s/{session}"):
            routes.append(Route(prefix + "/v1/models", self.models, methods=["GET"]))
            routes.append(Route(prefix + "/v1/models/{model:path}", self.model, methods=["GET"]))
            for path in APIS:
                routes.append(
                    Route(f"{prefix}/v1/{path}", self._completion_endpoint(path), methods=["POST"])
                )
        self.asgi = Starlette(routes=routes)

    # -- completions ---------------------------------------------------------------------------

    def _completion_endpoint(self, path: str) -> Any:
        wire = APIS[path]
        api = path.replace("/", "_")

        async def endpoint(request: Request) -> Response:
            try:
                self._authenticate(request)
                session_id = self._session_id(request)
                chat = wire.parse_request(
                    await read_json(
                        request, self.options.max_body_bytes, self.options.max_json_depth
                    )
                )
                self._served_model(chat.model)
                if self.observer is not None:
                    self.observer.admit(request.headers)
                with self.store.answering(session_id) as session:
                    completion = await _unless_disconnected(
                        request, self.proxy.complete(session, chat, api)
                    )
                    meta = await self._observe(session, completion, request.headers)
            except (
                RequestError
            ) as error:  # the client's to fix: the SDKs' automatic retries would not help
                return JSONResponse(
                    wire.error_body(error),
                    status_code=error.status,
                    headers=NO_RETRY if error.status < 500 else None,
                )
            except _Disconnected:
                return Response(status_code=499)  # nobody reads it; uvicorn needs an answer
            except (
                DataError
            ) as exc:  # the engine's word on this request (its context, its vocabulary)
                refusal = _engine_refusal(exc)
                return JSONResponse(wire.error_body(refusal), status_code=400, headers=NO_RETRY)
            except Exception as exc:  # the engine failed: the client's request was fine
                log.error("completion failed", api=api, error=f"{type(exc).__name__}: {exc}")
                failure = RequestError(
                    f"the inference engine failed: {type(exc).__name__}: {exc}",
                    status=502,
                    kind="api_error",
                )
                return JSONResponse(wire.error_body(failure), status_code=502)
            headers = {
                f"x-plait-{key.replace('_', '-')}": str(value) for key, value in meta.items()
            }
            if chat.stream:
                return StreamingResponse(
                    _iterate(wire.stream_events(chat, completion)),
                    media_type="text/event-stream",
                    headers={"cache-control": "no-cache", **headers},
                )
            body = wire.response_body(chat, completion)
            return JSONResponse({**body, "plait": meta} if meta else body, headers=headers)

        return endpoint

    async def _observe(
        self, session: ProxySession, completion: Completion, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        if self.observer is None:
            return {}
        try:
            return await self.observer.completed(session, completion, headers)
        except RequestError:
            raise
        except Exception as exc:  # not recorded, so not answered: the client may retry
            log.error("recording an answer failed", error=f"{type(exc).__name__}: {exc}")
            raise RequestError(
                f"the answer could not be recorded ({type(exc).__name__}: {exc}); retry",
                status=503,
                kind="api_error",
            ) from exc

    def _authenticate(self, request: Request) -> None:
        if self.options.api_key is None:
            return
        given = _api_key(request)
        if given is None or not hmac.compare_digest(given.encode(), self.options.api_key.encode()):
            raise RequestError("missing or wrong API key", status=401, kind="authentication_error")

    def _session_id(self, request: Request) -> str | None:
        """The session the request names; None for one of its own (`session_per_request`)."""
        session = request.path_params.get("session") or request.headers.get("x-plait-session")
        key_names_session = self.options.api_key is None and not self.options.session_per_request
        if not session and key_names_session:
            session = _api_key(request)
        if not session and self.options.session_per_request:
            return None
        if not session:
            # with --api-key the key authenticates, so it cannot name the session as well
            where = "the path (/s/<id>/v1/...) or the X-Plait-Session header"
            if key_names_session:
                where = "the path (/s/<id>/v1/...), the X-Plait-Session header, or the API key"
            raise RequestError(f"no session: put its id in {where}", param="session")
        if len(session) > 256:
            raise RequestError("the session id is over 256 characters", param="session")
        return session

    # -- models and sessions -------------------------------------------------------------------

    def _model_names(self) -> tuple[str, ...]:
        return (self.proxy.model_name, *self.options.served_model_names)

    def _served_model(self, name: str) -> None:
        if self.options.any_model or name in self._model_names():
            return
        served = ", ".join(repr(served) for served in self._model_names())
        raise RequestError(
            f"The model `{name[:200]}` does not exist: this server serves {served} "
            "(--served-model-name adds names)",
            status=404,
            param="model",
            kind="model_not_found",
        )

    async def health(self, request: Request) -> Response:
        return await self._session_call(
            request, lambda: {"status": "ok", "sessions": len(self.store)}
        )

    async def models(self, request: Request) -> Response:
        def listing() -> dict[str, Any]:
            names = self._model_names()
            cards = [_model_card(name) for name in names]
            # OpenAI's list and Anthropic's page in one body: each SDK reads its own keys
            return {
                "object": "list",
                "data": cards,
                "has_more": False,
                "first_id": names[0],
                "last_id": names[-1],
            }

        return await self._model_call(request, listing)

    async def model(self, request: Request) -> Response:
        def card() -> dict[str, Any]:
            name = request.path_params["model"]
            self._served_model(name)
            return _model_card(name)

        return await self._model_call(request, card)

    async def _model_call(self, request: Request, action: Any) -> Response:
        """A models endpoint, shared by both APIs: its errors in the shape of the API whose SDK
        asks (the Anthropic SDK sends `anthropic-version`)."""
        wire: WireFormat = (
            anthropic_messages if "anthropic-version" in request.headers else openai_chat
        )
        try:
            self._authenticate(request)
            return JSONResponse(action())
        except RequestError as error:
            return JSONResponse(wire.error_body(error), status_code=error.status)

    async def open_session(self, request: Request) -> Response:
        return await self._session_call(request, lambda: {"session": self.store.open().id})

    async def list_sessions(self, request: Request) -> Response:
        return await self._session_call(
            request,
            lambda: {
                "sessions": [
                    {"session": s.id, "calls": len(s.calls), "in_flight": s.in_flight}
                    for s in self.store
                ]
            },
        )

    async def show_session(self, request: Request) -> Response:
        session = request.path_params["session"]
        return await self._session_call(request, lambda: self._live(session).to_json())

    async def finish_session(self, request: Request) -> Response:
        session = request.path_params["session"]
        return await self._session_call(request, lambda: self.store.finish(session).to_json())

    async def discard_session(self, request: Request) -> Response:
        session = request.path_params["session"]

        def discard() -> dict[str, str]:
            self.store.discard(session)
            return {"session": session}

        return await self._session_call(request, discard)

    def _live(self, session_id: str) -> Any:
        if session_id not in self.store.sessions:
            raise RequestError(f"unknown session {session_id!r}", status=404)
        return self.store.sessions[session_id]

    def _guarded(self, endpoint: Any) -> Any:
        """An extra route's endpoint behind the API key, its RequestErrors in OpenAI's shape."""

        async def call(request: Request) -> Response:
            try:
                self._authenticate(request)
                return await endpoint(request)
            except RequestError as error:
                return JSONResponse(openai_common.error_body(error), status_code=error.status)

        return call

    async def _session_call(self, request: Request, action: Any) -> Response:
        try:
            self._authenticate(request)
            return JSONResponse(action())
        except RequestError as error:
            return JSONResponse({"detail": error.message}, status_code=error.status)

    # -- serving -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """Serve in this event loop (the engine's) until the block ends; yields the base URL."""
        async with serving(
            self.asgi, self.options.host, self.options.port, "proxy's server"
        ) as url:
            yield url


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    """A request's JSON body, read no further than `max_bytes` (413) and `max_depth` (400)."""
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise RequestError(f"the body is over {max_bytes} bytes", status=413)
    try:
        return parse_json(bytes(body), max_depth)
    except ValueError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None


def _model_card(name: str) -> dict[str, Any]:
    """A model as both APIs describe one."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "plait",
        "type": "model",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
    }


def _engine_refusal(error: DataError) -> RequestError:
    if (
        "max_model_len" in error.message
    ):  # worded so that litellm (mini-swe-agent) stops, not retries
        return RequestError(
            f"This model's maximum context length is exceeded: {error.message}",
            param="messages",
            kind="context_length_exceeded",
        )
    return RequestError(f"the engine refused the request: {error.message}", param="messages")


class _Disconnected(Exception):
    pass


async def _unless_disconnected(request: Request, work: Any) -> Completion:
    """`work`'s result, or _Disconnected (with `work` cancelled) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _Disconnected


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _api_key(request: Request) -> str | None:
    authorization = request.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip() or None
    return request.headers.get("x-api-key") or None


async def _iterate(events: Iterator[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event
