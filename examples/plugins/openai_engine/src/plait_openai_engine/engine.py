"""The "openai" engine: `plait.protocols.InferenceEngine` over an OpenAI-compatible server.

Sampling streams `POST /v1/completions`, so pause is honest: "abort" closes the in-flight streams
(the server drops those requests) and returns what each has; "keep" does the same, then continues
each unfinished completion from its tokens after `resume()`; "wait" lets them finish.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from typing import Any

import attrs
import httpx

from plait import api as pt
from plait.api import DataError, EngineError, ResolvedModel, non_negative, positive

_URL_FIX = "start the server, or set inference.options.url to where it listens"


@attrs.frozen
class OpenAIOptions:
    url: str = "http://127.0.0.1:8000"  # the server's base URL, without /v1
    model: str | None = None  # the served model name; None = the first one GET /v1/models lists
    api_key: str | None = None  # sent as a bearer token; None = $OPENAI_API_KEY when set
    weight_version: int = attrs.field(
        default=0, validator=non_negative
    )  # the served checkpoint's step
    timeout_s: float = attrs.field(
        default=600.0, validator=positive
    )  # longest silence of the server


@attrs.define
class _Seq:
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    reason: pt.StopReason | None = None

    def sampled(self, weight_version: int) -> pt.SampledSequence:
        if self.reason is None:  # unreachable: `_run` finishes every sequence or raises
            raise EngineError("a sample ended without a stop reason")
        return pt.SampledSequence(
            self.tokens, self.logprobs, self.reason, weight_version=weight_version
        )


def _stop_params(stop: pt.StopSpec) -> dict[str, Any]:
    """plait's stop rule: None keeps end-of-sequence; [] disables it; strings or ids replace it."""
    items = (stop,) if isinstance(stop, str) else tuple(stop or ())
    key = "stop" if all(isinstance(s, str) for s in items) else "stop_token_ids"
    return {} if stop is None else {"ignore_eos": True, key: list(items)}


class OpenAIEngine:
    def __init__(
        self, model: ResolvedModel, *, options: OpenAIOptions | None = None, seed: int = 0
    ) -> None:
        self.model, self.options = model, options or OpenAIOptions()
        self.url = self.options.url.rstrip("/")
        self._served: dict[str, Any] = {}  # the model's entry in GET /v1/models
        self.weight_version = self.options.weight_version  # no weight updates: it never changes
        self._rng = random.Random(seed)
        self._paused: asyncio.Future[None] | None = None  # done on resume()
        self._inflight: dict[asyncio.Task[None], str | None] = {}  # stream -> the pause that cut it
        key = self.options.api_key or os.environ.get("OPENAI_API_KEY")
        self._client = httpx.AsyncClient(  # short keep-alive: servers drop idle connections
            base_url=self.url,
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(self.options.timeout_s, connect=10.0),
            limits=httpx.Limits(keepalive_expiry=1),
        )

    async def _call(
        self, method: str, path: str, body: Any = None, stream: bool = False
    ) -> httpx.Response:
        try:
            reply = await self._client.send(
                self._client.build_request(method, path, json=body), stream=stream
            )
        except httpx.TransportError as exc:  # refused, or no answer within timeout_s
            raise EngineError(
                f"cannot reach the server at {self.url} ({method} {path}): {exc!r}",
                fix=f"{_URL_FIX}; or raise inference.options.timeout_s",
            ) from exc
        if reply.status_code == 200:
            return reply
        error = DataError if reply.status_code == 400 else EngineError  # 400: the request's fault
        text = (await reply.aread()).decode(errors="replace")[:500]
        raise error(f"the server answered {method} {path} with HTTP {reply.status_code}: {text}")

    async def _model(self) -> str:
        if not self._served:
            models = (await self._call("GET", "/v1/models")).json().get("data") or []
            self._served = next((m for m in models if self.options.model in (None, m["id"])), {})
            if not self._served:
                raise EngineError(
                    f"{self.url}/v1/models lists {[m['id'] for m in models]}, "
                    f"not {self.options.model or 'a model'}",
                    fix="set inference.options.model to a model the server lists",
                )
        return str(self._served["id"])

    async def health(self) -> pt.EngineHealth:
        try:
            return pt.EngineHealth(
                True, self.weight_version, f"{self.url} serving {await self._model()}"
            )
        except EngineError as exc:
            return pt.EngineHealth(False, self.weight_version, str(exc))

    async def sample(
        self, prompt: pt.ModelInput, num_samples: int, sampling_params: pt.SamplingParams
    ) -> pt.SampleResponse:
        ids, p = prompt.to_ints(), sampling_params
        if not ids or num_samples < 1:
            raise DataError(
                f"num_samples must be >= 1, got {num_samples}"
                if ids
                else "empty prompt: nothing to sample from"
            )
        # max_tokens=None fills the context, whose length vLLM and SGLang list there
        await self._model()
        room = (self._served.get("max_model_len") or 0) - len(ids)
        body = {
            "n": num_samples,
            "max_tokens": p.max_tokens or (room if room > 0 else None),
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": p.seed if p.seed is not None else self._rng.getrandbits(31),
            **_stop_params(p.stop),
            **({"top_k": p.top_k} if p.top_k != -1 else {}),
        }
        seqs = [_Seq() for _ in range(num_samples)]
        await self._run(ids, seqs, body)
        return pt.SampleResponse([s.sampled(self.weight_version) for s in seqs])

    async def _run(self, ids: list[int], seqs: list[_Seq], body: dict[str, Any]) -> None:
        """Stream one request into `seqs`; after a "keep" cut, each unfinished one continues."""
        while self._paused is not None:
            await asyncio.shield(self._paused)
        stream = asyncio.ensure_future(self._stream(ids, seqs, body))
        self._inflight[stream] = None
        try:
            await asyncio.wait([stream])
        finally:
            stream.cancel()  # a no-op unless our caller was cancelled
            cut = self._inflight.pop(stream)
        if cut is None or not stream.cancelled():
            return stream.result()
        for s in seqs if cut == "abort" else ():
            s.reason = s.reason or "abort"
        await asyncio.gather(
            *(
                self._run(
                    ids + s.tokens,
                    [s],
                    {
                        **body,
                        "n": 1,
                        "seed": body["seed"] + i + len(s.tokens),
                        "max_tokens": body["max_tokens"] and body["max_tokens"] - len(s.tokens),
                    },
                )
                for i, s in enumerate(seqs)
                if s.reason is None
            )
        )

    async def _stream(self, ids: list[int], seqs: list[_Seq], body: dict[str, Any]) -> None:
        reply = await self._call(
            "POST",
            "/v1/completions",
            {
                **body,
                "model": await self._model(),
                "prompt": ids,
                "logprobs": 0,
                "stream": True,
                "return_token_ids": True,
            },
            stream=True,
        )
        try:
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise EngineError(f"the server failed a completion: {chunk['error']}")
                for choice in chunk["choices"]:
                    if choice.get("token_ids") is None:
                        raise EngineError(
                            "the server returns no token ids",
                            fix="use a server that supports return_token_ids (vLLM, SGLang)",
                        )
                    s = seqs[choice["index"]]
                    s.tokens += choice["token_ids"]
                    s.logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
                    if choice.get("finish_reason") is not None:
                        s.reason = (
                            choice["finish_reason"]
                            if choice["finish_reason"] in ("length", "abort")
                            else "stop"
                        )
        except httpx.HTTPError as exc:
            raise EngineError(
                f"the stream from {self.url} broke off: {exc!r}", fix=_URL_FIX
            ) from exc
        finally:
            await reply.aclose()
        if any(s.reason is None or len(s.tokens) != len(s.logprobs) for s in seqs):
            raise EngineError(
                "the server's stream ended without every sample finished, or with logprobs missing"
            )

    async def compute_logprobs(self, prompt: pt.ModelInput) -> list[float | None]:
        """By the legacy `echo` + `logprobs`: the prompt comes back with each token's logprob."""
        ids = prompt.to_ints()
        reply = await self._call(
            "POST",
            "/v1/completions",
            {
                "model": await self._model(),
                "prompt": ids,
                "max_tokens": 1,
                "echo": True,
                "logprobs": 0,
            },
        )
        values = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
        if len(values) < len(ids):
            raise EngineError(
                f"the server echoed {len(values)} logprobs for a prompt of {len(ids)} tokens"
            )
        return [None, *values[1 : len(ids)]]

    async def pause(self, mode: pt.PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        self._paused = self._paused or asyncio.get_running_loop().create_future()
        streams = [stream for stream in self._inflight if not stream.done()]
        if mode == "wait" and streams:
            await asyncio.wait(streams)
        for stream in streams if mode != "wait" else ():
            self._inflight[stream] = mode
            stream.cancel()

    async def resume(self) -> None:
        if self._paused is not None:
            self._paused.set_result(None)
            self._paused = None

    async def apply_weights(self, update: pt.WeightUpdate) -> None:
        raise EngineError(
            f"the openai inference engine cannot take weight updates (version {update.version}): "
            "an OpenAI-compatible server has no API to load weights",
            fix="train with an engine that takes them (e.g. inference.engine = 'vllm'); this one "
            "serves a fixed checkpoint, tagged inference.options.weight_version",
        )

    async def close(self) -> None:
        await self.pause("abort")  # in-flight requests return what they have
        await self.resume()
        await self._client.aclose()
