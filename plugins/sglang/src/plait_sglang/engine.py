"""The "sglang" inference engine: an SGLang server, driven over HTTP.

Wire (SGLang 0.5.15 - 0.5.23; the README lists the drift the plugin copes with):

- sampling: `POST /generate` with a batch of `num_samples` copies of the prompt as `input_ids`,
  one `sampling_params` per copy (SGLang gives every copy of a request the same
  `sampling_seed`, so each gets seed + i), `return_logprob: true`, `rid`s. Each reply element has
  `output_ids` (stop token included) and `meta_info`: `output_token_logprobs` as
  `[logprob, token_id, null]` triples, `finish_reason` `{"type": "stop"|"length"|"abort", ...}`
  (an abort is an HTTP 200 with the partial output), `weight_version`, per-token
  `weight_versions` spans (0.5.23), and `routed_experts` (base64 of raw int32) when asked.
  The server is launched with SGLANG_RETURN_ORIGINAL_LOGPROB=1, so logprobs are the raw
  distribution's, as the trainer computes them.
- grammars: `SamplingParams.grammar` goes as the `ebnf` sampling param (SGLang compiles it with
  its grammar backend, xgrammar by default; a grammar that does not compile is an HTTP 400).
- prompt logprobs: `/generate` with `max_new_tokens: 0`, `logprob_start_len: 0`.
- stops: None keeps SGLang's EOS stop; [] sends `ignore_eos`; strings go as `stop` (with
  `ignore_eos`); token ids go as `stop_token_ids` without `ignore_eos`, because SGLang's
  `ignore_eos` also turns `stop_token_ids` off: so those requests stop at EOS too.
- pause: "keep" -> `POST /pause_generation {"mode": "retract"}` (or "in_place", options.keep_mode),
  "abort" -> `{"mode": "abort"}`; resume -> `POST /continue_generation`. SGLang has no "wait"
  mode: the plugin holds new requests and waits for its in-flight ones to finish.
- weights: by disk `POST /update_weights_from_disk {"model_path", "weight_version", "flush_cache"}`
  (version and weights change in one call); by version bump `POST /update_weight_version`
  (`abort_all_requests: false`; SGLang's default aborts everything); by the distributed API
  `/init_weights_update_group`, `/update_weights_from_distributed` (concurrent with the trainer's
  broadcast), `/destroy_weights_update_group`.
- cache rule: every update flushes the radix cache (`flush_cache: true`) except while requests are
  held in an "in_place" pause, where SGLang refuses to flush (their KV stays the old weights').
- LoRA: `/load_lora_adapter {"lora_name", "lora_path"}`, `/unload_lora_adapter`; a request names
  its adapter in `lora_path`.
"""

from __future__ import annotations

import base64
import json
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from plait.api import (
    DataError,
    EngineError,
    ModelInput,
    PauseMode,
    ResolvedModel,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TensorData,
    prompt_token_ids,
)
from plait_server.engine import (
    ServerEngine,
    parse_weight_version,
    sampling_room,
    token_versions,
)
from plait_sglang.options import SGLangOptions
from plait_weights.capabilities import BroadcastGroup, TensorMeta

log = structlog.get_logger("plait_sglang")

_FINISH: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "abort"}
GROUP_NAME = "weight_update_group"


def stop_params(stop: Any) -> dict[str, Any]:
    """plait's `SamplingParams.stop` as SGLang sampling params (see the module docstring)."""
    if stop is None:
        return {}
    if isinstance(stop, str):
        stop = (stop,)
    items = tuple(stop)
    if not items:
        return {"ignore_eos": True}
    if all(isinstance(s, str) for s in items):
        if not all(items):
            raise DataError("SamplingParams.stop contains an empty string", fix="remove it")
        return {"stop": list(items), "ignore_eos": True}
    if all(isinstance(s, int | np.integer) and not isinstance(s, bool) for s in items):
        return {"stop_token_ids": [int(s) for s in items]}
    raise DataError(
        f"SamplingParams.stop mixes strings and token ids: {items!r}",
        fix="give either stop strings or stop token ids",
    )


def decode_routed_experts(encoded: str | None, num_layers: int, top_k: int) -> TensorData | None:
    """SGLang's `routed_experts`: base64 of raw little-endian int32 (no header), reshaped to
    (positions, layers, experts per token), kept in the narrowest dtype that holds the ids
    (`TensorData.compact`: uint8 below 256 experts)."""
    if encoded is None:
        return None
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if flat.size % (num_layers * top_k):
        raise EngineError(
            f"routed_experts has {flat.size} ids, not a multiple of layers x top-k = "
            f"{num_layers} x {top_k}"
        )
    return TensorData.compact(flat.reshape(-1, num_layers, top_k))


class SGLangEngine(ServerEngine):
    """`plait.protocols.InferenceEngine` (plus `DiskWeightLoader` and `BroadcastWeightReceiver`)
    on an SGLang server (or plait's fake of one)."""

    server_name = "SGLang"
    options: SGLangOptions

    def __init__(
        self, model: ResolvedModel, *, options: SGLangOptions | None = None, seed: int = 0
    ) -> None:
        super().__init__(model, options or SGLangOptions(), seed)
        config = json.loads((Path(model.path) / "config.json").read_text())
        self._moe_shape = (
            int(config.get("num_hidden_layers", 0)),
            int(config.get("num_experts_per_tok", 0)),
        )
        self._server_paused = False
        self._pause_mode: PauseMode | None = None

    def launch_command(self, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        o = self.options
        argv = [
            o.python or sys.executable,
            "-m",
            o.launch_module,
            "--model-path",
            str(self.model.path),
            "--tokenizer-path",
            str(self.model.tokenizer_path),
            "--host",
            o.host,
            "--port",
            str(port),
            "--dtype",
            o.dtype or self.model.dtype,
            "--context-length",
            str(o.context_length),
            "--random-seed",
            str(seed),
        ]
        if o.enable_lora:
            argv += [
                "--enable-lora",
                "--max-lora-rank",
                str(o.max_lora_rank),
                "--max-loras-per-batch",
                str(o.max_loras_per_batch),
                "--lora-target-modules",
                "all",
            ]
        if o.enable_return_routed_experts:
            argv.append("--enable-return-routed-experts")
        if o.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(o.mem_fraction_static)]
        if o.api_key:
            argv += ["--api-key", o.api_key]
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"} if o.return_original_logprob else {}
        return argv + list(o.server_args), {**env, **o.env}

    async def _on_ready(self) -> None:
        info = await self.http.json("GET", "/model_info")
        self._version = parse_weight_version(info.get("weight_version"))

    async def _status(self) -> str:
        return f"{'paused' if self._gate.paused else 'running'}; {self.http.base_url}"

    # -- sampling -------------------------------------------------------------------------

    async def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        *,
        lora: str | None = None,
    ) -> SampleResponse:
        """`num_samples` completions; `lora` names an adapter loaded with `load_lora_adapter`."""
        ids, room = sampling_room(
            prompt, num_samples, self.vocab_size, self.options.context_length, "context_length"
        )
        params = sampling_params
        seed = self._seed(params.seed)
        common = {
            "max_new_tokens": min(params.max_tokens or room, room),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            **stop_params(params.stop),
            **({"ebnf": params.grammar} if params.grammar is not None else {}),
        }
        rid = uuid.uuid4().hex
        body: dict[str, Any] = {
            "input_ids": [ids] * num_samples,
            "sampling_params": [
                {**common, "sampling_seed": (seed + i) % 2**31} for i in range(num_samples)
            ],
            "return_logprob": True,
            "rid": [f"plait-{rid}-{i}" for i in range(num_samples)],
        }
        if params.top_logprobs:
            body["top_logprobs_num"] = params.top_logprobs
        if lora:
            body["lora_path"] = lora
        if self.options.enable_return_routed_experts:
            body["return_routed_experts"] = True
        start_version = self._version
        replies = await self._generate(body)
        return SampleResponse([self._sequence(reply, start_version) for reply in replies])

    def _sequence(self, reply: dict[str, Any], start_version: int) -> SampledSequence:
        meta = reply["meta_info"]
        tokens = list(reply.get("output_ids") or [])
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(tokens):
            raise EngineError(f"SGLang returned {len(tokens)} tokens but {len(entries)} logprobs")
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type")
        if reason not in _FINISH:
            raise EngineError(f"SGLang finished a sample with reason {finish!r}")
        label = (
            parse_weight_version(meta.get("weight_version"))
            if "weight_version" in meta
            else start_version
        )
        versions = token_versions(meta.get("weight_versions"), len(tokens), label)
        routed = None
        if self.options.enable_return_routed_experts:
            if "routed_experts" not in meta:
                raise EngineError(
                    "SGLang returned no routed_experts",
                    fix="use SGLang >= 0.5.7 launched with --enable-return-routed-experts, "
                    "on a MoE model",
                )
            routed = decode_routed_experts(meta["routed_experts"], *self._moe_shape)
        return SampledSequence(
            tokens,
            [e[0] for e in entries],
            _FINISH[reason],
            weight_version=versions[-1] if versions else label,
            token_versions=versions,
            routed_experts=routed,
            top_logprobs=_top_logprobs(meta.get("output_top_logprobs")),
        )

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        ids = prompt_token_ids(prompt, self.vocab_size)
        if len(ids) > self.options.context_length:
            raise DataError(
                f"prompt of {len(ids)} tokens exceeds context_length {self.options.context_length}",
                fix="shorten the prompt or raise inference.options.context_length",
            )
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        reply = await self._generate(body)
        entries = reply["meta_info"].get("input_token_logprobs") or []
        if len(entries) != len(ids):
            raise EngineError(
                f"SGLang returned {len(entries)} prompt logprobs for a prompt of {len(ids)} tokens"
            )
        return [None, *(float(e[0]) for e in entries[1:])]

    async def _generate(self, body: dict[str, Any]) -> Any:
        async def send() -> Any:
            return await self.http.request(
                "POST", "/generate", json=body, timeout_s=self.options.request_timeout_s
            )

        return (await self._reissued_after_restart(send, in_flight=True)).json()

    # -- pause / resume -------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        await self._ensure_ready()
        self._gate.pause()
        self._pause_mode = mode
        if mode == "wait":  # SGLang has no such mode: hold new requests, let ours finish
            await self._wait_idle(self.options.request_timeout_s)
            return
        server_mode = self.options.keep_mode if mode == "keep" else "abort"
        await self.http.request("POST", "/pause_generation", json={"mode": server_mode})
        self._server_paused = True

    async def resume(self) -> None:
        await self._ensure_ready()
        if self._server_paused:
            await self.http.request("POST", "/continue_generation", json={})
            self._server_paused = False
        self._pause_mode = None
        self._gate.resume()

    # -- weights --------------------------------------------------------------------------

    def _flush_allowed(self) -> bool:
        """SGLang refuses to flush its cache while requests are held in an in-place pause."""
        return not (self._pause_mode == "keep" and self.options.keep_mode == "in_place")

    async def _weights_call(self, path: str, body: dict[str, Any]) -> None:
        await self._ensure_ready()
        async with self._lock():
            await self.http.request(
                "POST", path, json=body
            )  # 400 {"success": false, "message"} -> EngineError

    async def _load_weights_from_disk(self, path: str, version: int) -> None:
        await self._weights_call(
            "/update_weights_from_disk",
            {
                "model_path": str(path),
                "weight_version": str(version),
                "flush_cache": self._flush_allowed(),
                "abort_all_requests": False,
            },
        )
        self._version = int(version)
        log.debug("weights loaded from disk", path=path, version=version)

    async def _set_weight_version(self, version: int) -> None:
        await self._weights_call(
            "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
        )
        self._version = int(version)

    async def weight_broadcast_ranks(self) -> int:
        await self._ensure_ready()
        info = await self.http.json("GET", "/server_info")
        return int(info.get("tp_size", 1)) * int(info.get("pp_size", 1))

    async def join_weight_broadcast(self, group: BroadcastGroup) -> None:
        await self._ensure_ready()
        await self.http.request(
            "POST",
            "/init_weights_update_group",
            json={
                "master_address": group.master_address,
                "master_port": group.master_port,
                "rank_offset": group.rank_offset,
                "world_size": group.world_size,
                "group_name": GROUP_NAME,
                "backend": group.backend,
            },
        )
        self._in_broadcast_group = True

    async def receive_weight_broadcast(
        self, tensors: Sequence[TensorMeta], version: int | None
    ) -> None:
        body: dict[str, Any] = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": GROUP_NAME,
            "flush_cache": version is not None and self._flush_allowed(),
        }
        if version is not None:
            body["weight_version"] = str(version)
        self._weights_from_broadcast = True  # from the first bucket on, no copy is on disk
        await self._weights_call("/update_weights_from_distributed", body)
        if version is not None:
            self._version = int(version)

    async def leave_weight_broadcast(self) -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": GROUP_NAME})
        self._in_broadcast_group = False

    # -- LoRA -----------------------------------------------------------------------------

    async def _load_lora_adapter(self, name: str, path: str) -> None:
        await self._weights_call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def _unload_lora_adapter(self, name: str) -> None:
        await self._weights_call("/unload_lora_adapter", {"lora_name": name})


def _top_logprobs(
    positions: list[list[list[Any]]] | None,
) -> tuple[tuple[tuple[int, float], ...], ...] | None:
    """`output_top_logprobs` ([logprob, token id, text] per candidate per position) as
    (token, logprob) pairs; None when not asked for."""
    if positions is None:
        return None
    return tuple(tuple((int(t), float(lp)) for lp, t, _ in pos or ()) for pos in positions)
