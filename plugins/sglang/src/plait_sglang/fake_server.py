"""A stand-in SGLang server: SGLang's HTTP wire protocol, computed by a real transformers model.

SGLang has no CPU build for these machines, so plait's tests (and anyone without a GPU) run this
instead of `python -m sglang.launch_server`. It takes the same command-line flags plait passes
and answers every endpoint plait-sglang uses exactly as SGLang does (checked against the
`sglang` package's `api_types.py` and `io_struct.py`; see tests/test_wire_fidelity.py): paths,
methods, bodies and their defaults, status codes, plain-text (`/flush_cache`) and empty
(`/abort_request`) replies, aborts as HTTP 200 with partial output, `/generate` calls that block
while generation is paused, `/flush_cache` refused (400) while requests run.

What it computes is real: a Hugging Face causal LM (the model directory's weights; reloaded by
`/update_weights_from_disk`, or received over a gloo broadcast by
`/update_weights_from_distributed`), sampled with a generator seeded by `sampling_seed`. So tokens
and logprobs are a deterministic function of (weights, prompt, seed) and match a trainer on the
same weights, and a test sees a weight sync land. Like SGLang, it returns the temperature-scaled
logprobs unless `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (plait sets it: the trainer's logprobs are the
raw ones). An `ebnf` sampling param constrains decoding as SGLang's grammar backend does: the
model's EOS tokens only where the grammar accepts, and the request ends when one is sampled there
(llguidance here, xgrammar in SGLang; both read the same GBNF); a grammar that does not compile is
a 400 "Failed to compile ebnf grammar: ...", two constraints at once a 400 as SGLang's `verify`
answers. Requests run one at a time per decode step (no batching) and the prefix cache is keyed
by the exact prompt; `retract` frees a request's KV and re-prefills it on continue, `in_place`
keeps it.

`--fake-version` picks the SGLang release whose wire it speaks (the releases differ):
0.5.23 (default): /generate rejects unknown `sampling_params` keys (400, the contract gate),
  `/begin_weight_update` and `/end_weight_update` exist, no `/get_weight_version`.
0.5.15: no contract gate, no begin/end, `/get_weight_version` answers 404 "deprecated".
0.5.9: `total_retractions` instead of `num_retractions`, `/get_weight_version` answers.
0.5.6: as 0.5.9, and no routed experts (R3 came in 0.5.7).

    python -m plait_sglang.fake_server --model-path DIR --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from plait_hf.grammar_mask import GrammarError, GrammarMatcher, GrammarVocabulary

VERSIONS = ("0.5.6", "0.5.9", "0.5.15", "0.5.23")
BATCH_WINDOW_S = 0.02
REQUIRED = object()

# Sampling-param keys of SGLang 0.5.23's contract (`api_types.SamplingParams`), in its order.
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)

# Bodies of the control endpoints (SGLang's io_struct request classes): field -> default.
CONTROL_BODIES: dict[str, dict[str, Any]] = {
    "UpdateWeightFromDiskReqInput": {
        "model_path": REQUIRED,
        "load_format": None,
        "abort_all_requests": False,
        "weight_version": None,
        "is_async": False,
        "torch_empty_cache": False,
        "keep_pause": False,
        "recapture_cuda_graph": False,
        "token_step": 0,
        "flush_cache": True,
        "manifest": None,
    },
    "InitWeightsUpdateGroupReqInput": {
        "master_address": REQUIRED,
        "master_port": REQUIRED,
        "rank_offset": REQUIRED,
        "world_size": REQUIRED,
        "group_name": "weight_update_group",
        "backend": "nccl",
    },
    "UpdateWeightsFromDistributedReqInput": {
        "names": REQUIRED,
        "dtypes": REQUIRED,
        "shapes": REQUIRED,
        "group_name": "weight_update_group",
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": None,
        "load_format": None,
        "selector": "all",
        "torch_empty_cache": False,
    },
    "DestroyWeightsUpdateGroupReqInput": {"group_name": "weight_update_group"},
    "PauseGenerationReqInput": {"mode": "abort"},
    "ContinueGenerationReqInput": {"torch_empty_cache": True},
    "UpdateWeightVersionReqInput": {"new_version": REQUIRED, "abort_all_requests": True},
    "LoadLoRAAdapterReqInput": {
        "lora_name": REQUIRED,
        "lora_path": REQUIRED,
        "pinned": False,
        "lora_id": None,
    },
    "UnloadLoRAAdapterReqInput": {"lora_name": REQUIRED, "lora_id": None},
    "AbortReq": {
        "abort_all": False,
        "finished_reason": None,
        "abort_message": None,
        "weight_versions": None,
    },
}
BASE_REQ = {"rid": None, "http_worker_ipc": None}  # BaseReq, every request class's base


class ContractError(ValueError):
    pass


def parse_body(cls: str, body: Any) -> dict[str, Any]:
    """A control body with SGLang's defaults filled in; unknown keys are ignored (msgspec)."""
    if not isinstance(body, dict):
        raise ContractError(f"Expected `object`, got `{type(body).__name__}`")
    fields = {**BASE_REQ, **CONTROL_BODIES[cls]}
    missing = [k for k, v in fields.items() if v is REQUIRED and k not in body]
    if missing:
        raise ContractError(f"Object missing required field `{missing[0]}`")
    return {k: body.get(k, v) for k, v in fields.items()}


def contract_error(body: Any) -> str | None:
    """0.5.23's /generate gate: the message `api_types` gives for unknown sampling_params keys."""
    params = body.get("sampling_params") if isinstance(body, dict) else None
    for item in params if isinstance(params, list) else [params]:
        for key in item or {}:
            if key not in SAMPLING_KEYS:
                listed = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
                return f"unknown field `{key}`, expected one of {listed}"
    return None


class Sequence_:
    """One generation request (one element of a batch)."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: dict[str, Any],
        body: dict[str, Any],
        index: int,
        seed: int,
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.return_logprob = _pick(body.get("return_logprob"), index) or False
        self.logprob_start_len = _pick(body.get("logprob_start_len"), index)
        self.top_logprobs_num = int(_pick(body.get("top_logprobs_num"), index) or 0)
        self.output_top_logprobs: list[list[list[Any]]] = []
        self.next_top: list[list[Any]] = []  # the sampled position's, until _commit
        self.return_routed_experts = bool(body.get("return_routed_experts"))
        self.routed_start = int(body.get("routed_experts_start_len") or 0)
        self.lora = _pick(body.get("lora_path"), index)
        self.generator = torch.Generator().manual_seed(seed)
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.input_logprobs: list[float | None] | None = None
        self.versions: list[str] = []
        self.routing: list[list[list[int]]] = []  # per forwarded position: layers x top-k
        self.cache: Any = None
        self.next_logits: torch.Tensor | None = None
        self.cached_tokens = 0
        self.retractions = 0
        self.finish: dict[str, Any] | None = None
        self.grammar: GrammarMatcher | None = None  # the `ebnf` param's matcher
        self.started = time.monotonic()
        self.done = asyncio.get_running_loop().create_future()


def _max_new_tokens(params: dict[str, Any]) -> int:
    value = params.get("max_new_tokens")
    return 128 if value is None else int(value)


def _pick(value: Any, index: int) -> Any:
    return value[index] if isinstance(value, list) else value


class FakeSGLang:
    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.args = args
        self.version = args.fake_version
        self.dtype = {
            "auto": torch.float32,
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
        }[args.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.config = self.model.config
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in (
            "1",
            "true",
        )
        self.is_moe = bool(getattr(self.config, "num_experts_per_tok", 0))
        self.weight_version = args.weight_version
        self.model_lock = threading.Lock()
        self.cond = asyncio.Condition()
        self.iteration = asyncio.Lock()  # held by the scheduler while an iteration runs
        self.is_pause = False
        self.pause_mode = "abort"
        self.waiting: collections.deque[Sequence_] = collections.deque()
        self.running: list[Sequence_] = []
        self.prefix_cache: collections.OrderedDict[tuple[Any, ...], tuple[Any, torch.Tensor]] = (
            collections.OrderedDict()
        )
        self.loras: dict[str, dict[str, torch.Tensor]] = {}
        self.groups: dict[str, Any] = {}
        self.record = open(args.record, "a") if args.record else None  # noqa: SIM115
        self.rng = torch.Generator().manual_seed(args.random_seed)
        self.grammar_vocabulary: GrammarVocabulary | None = None  # built on the first `ebnf`

    def grammar_matcher(self, ebnf: str) -> GrammarMatcher:
        if self.grammar_vocabulary is None:
            self.grammar_vocabulary = GrammarVocabulary(self.tokenizer, self.config.vocab_size)
        return self.grammar_vocabulary.matcher(ebnf)

    # -- scheduling ---------------------------------------------------------------------

    @property
    def scheduler_stopped(self) -> bool:
        return self.is_pause and self.pause_mode in ("retract", "in_place")

    async def run_scheduler(self) -> None:
        while True:
            async with self.cond:
                await self.cond.wait_for(
                    lambda: (self.running or self.waiting) and not self.scheduler_stopped
                )
            if self.waiting:  # a moment for requests sent together to join one batch, as in SGLang
                await asyncio.sleep(BATCH_WINDOW_S)
            async with self.cond:
                while self.waiting:
                    self.running.append(self.waiting.popleft())
            # One scheduler iteration: every running request advances by one token, and the
            # results land together (as one batched forward's would), then finished ones return.
            async with self.iteration:
                outcomes = []
                for seq in [s for s in self.running if s.finish is None]:
                    if self.scheduler_stopped:
                        break
                    outcomes.append((seq, await asyncio.to_thread(self.step, seq)))
                for seq, outcome in outcomes:
                    if seq.finish is None:  # not aborted while the iteration ran
                        self._commit(seq, *outcome)
                for seq in [s for s in self.running if s.finish is not None]:
                    self._finish(seq)

    def _finish(self, seq: Sequence_) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if not seq.done.done():
            seq.done.set_result(None)

    def step(self, seq: Sequence_) -> tuple[int | None, float, dict[str, Any] | None]:
        """Prefill (first step, or after a retract) or decode one token, then sample: (token,
        logprob, finish reason). Runs in a worker thread; `_commit` applies it on the loop."""
        with self.model_lock, self._adapter(seq.lora):
            if seq.cache is None:
                self._prefill(seq)
            else:
                logits, seq.cache = self._forward([seq.output_ids[-1]], seq.cache, seq)
                seq.next_logits = logits[-1]
            if len(seq.output_ids) >= _max_new_tokens(seq.params):
                return None, 0.0, {"type": "length", "length": len(seq.output_ids)}
            return self._sample(seq)

    def _commit(
        self, seq: Sequence_, token: int | None, logprob: float, finish: dict[str, Any] | None
    ) -> None:
        if token is not None:
            seq.output_ids.append(token)
            seq.output_logprobs.append(logprob)
            if seq.top_logprobs_num:
                seq.output_top_logprobs.append(seq.next_top)
            seq.versions.append(self.weight_version)
            if finish is None and len(seq.output_ids) >= _max_new_tokens(seq.params):
                finish = {"type": "length", "length": len(seq.output_ids)}
        seq.finish = finish

    def _prefill(self, seq: Sequence_) -> None:
        ids = seq.input_ids + seq.output_ids
        key = (seq.lora, *ids)  # like SGLang's radix cache, one namespace per LoRA adapter
        wants_input_logprobs = (
            seq.return_logprob and seq.logprob_start_len is not None and seq.logprob_start_len >= 0
        )
        hit = (
            self.prefix_cache.get(key)
            if not (wants_input_logprobs or seq.return_routed_experts)
            else None
        )
        if (
            hit is not None
        ):  # KV as computed then, even if the weights changed since (unless flushed)
            seq.cache, seq.next_logits = _copy_cache(hit[0]), hit[1]
            seq.cached_tokens = len(ids)
            return
        logits, seq.cache = self._forward(ids, None, seq)
        seq.next_logits = logits[-1]
        if wants_input_logprobs and seq.input_logprobs is None:
            logprobs = torch.log_softmax(logits[:-1].float(), -1)
            values = logprobs.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
            seq.input_logprobs = [None, *values][seq.logprob_start_len : len(seq.input_ids)]
        if not seq.output_ids:
            self.prefix_cache[key] = (_copy_cache(seq.cache), seq.next_logits)
            while len(self.prefix_cache) > 64:
                self.prefix_cache.popitem(last=False)

    def _forward(self, ids: list[int], cache: Any, seq: Sequence_) -> tuple[torch.Tensor, Any]:
        with torch.inference_mode():
            kwargs = (
                {"output_router_logits": True} if self.is_moe and seq.return_routed_experts else {}
            )
            out = self.model(
                input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, **kwargs
            )
        if kwargs and out.router_logits is not None:
            top_k = self.config.num_experts_per_tok
            per_layer = [
                r.reshape(-1, r.shape[-1])[-len(ids) :].topk(top_k, -1).indices
                for r in out.router_logits
            ]
            seq.routing.extend(torch.stack(per_layer, 1).tolist())
        return out.logits[0], out.past_key_values

    def _sample(self, seq: Sequence_) -> tuple[int, float, dict[str, Any] | None]:
        params = seq.params
        assert seq.next_logits is not None  # step() has just run the forward
        logits = seq.next_logits.float()
        temperature = float(
            params.get("temperature", 1.0) if params.get("temperature") is not None else 1.0
        )
        raw = torch.log_softmax(logits, -1)
        if seq.grammar is not None:  # the grammar's stop tokens are the model's EOS ids
            allowed = torch.from_numpy(seq.grammar.allowed(self.eos_ids))
            logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        if temperature <= 1e-5:
            token = int(logits.argmax())
            scaled = raw
        else:
            scaled = torch.log_softmax(logits / temperature, -1)
            probs = _filter(
                scaled.exp(), int(params.get("top_k") or -1), float(params.get("top_p") or 1.0)
            )
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        reported = raw if self.original_logprob else scaled
        logprob = float(reported[token])
        if seq.top_logprobs_num:  # SGLang: from the same logprobs as the token's, [lp, id, text]
            values, ids = reported.topk(seq.top_logprobs_num)
            seq.next_top = [
                [v, i, None] for v, i in zip(values.tolist(), ids.tolist(), strict=True)
            ]
        if seq.grammar is not None:
            if token in self.eos_ids:  # SGLang: a terminated grammar finishes the request
                return token, logprob, {"type": "stop", "matched": token}
            seq.grammar.advance(token)
        # SGLang's token-based stop: ignore_eos turns off stop_token_ids as well as the EOS ids
        if not params.get("ignore_eos") and token in self.eos_ids | set(
            params.get("stop_token_ids") or ()
        ):
            return token, logprob, {"type": "stop", "matched": token}
        stops = params.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        if stops:
            text = self.tokenizer.decode([*seq.output_ids, token])
            for stop in stops:
                if stop in text:
                    return token, logprob, {"type": "stop", "matched": stop}
        return token, logprob, None

    def _adapter(self, name: str | None) -> AbstractContextManager[None]:
        """Run with LoRA adapter `name` merged into the weights (restored after)."""
        import contextlib

        if not name:
            return contextlib.nullcontext()
        deltas = self.loras.get(name)
        if deltas is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        params = dict(self.model.named_parameters())

        @contextlib.contextmanager
        def merged() -> Iterator[None]:
            originals = {n: params[n].detach().clone() for n in deltas}
            for n, delta in deltas.items():
                params[n].data += delta.to(params[n].dtype)
            try:
                yield
            finally:
                for n, original in originals.items():
                    params[n].data.copy_(original)

        return merged()

    # -- replies ------------------------------------------------------------------------

    def reply(self, seq: Sequence_) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": seq.finish,
            "prompt_tokens": len(seq.input_ids),
            "weight_version": self.weight_version,
            "input_token_logprobs": [
                [lp, t, None]
                for lp, t in zip(
                    seq.input_logprobs or [],
                    seq.input_ids[seq.logprob_start_len or 0 :],
                    strict=False,
                )
            ]
            if seq.return_logprob
            else [],
        }
        meta["total_retractions" if self.version in ("0.5.6", "0.5.9") else "num_retractions"] = (
            seq.retractions
        )
        if seq.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(seq.output_logprobs, seq.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(seq.output_ids)
            if seq.top_logprobs_num:
                meta["output_top_logprobs"] = seq.output_top_logprobs
        meta.update(
            {
                "reasoning_tokens": 0,
                "completion_tokens": len(seq.output_ids),
                "cached_tokens": seq.cached_tokens,
            }
        )
        if self.version == "0.5.23":
            meta["weight_versions"] = _spans(seq.versions)
        if seq.return_routed_experts and self.version != "0.5.6" and self.is_moe:
            end = len(seq.input_ids) + len(seq.output_ids) - 1
            data = (
                torch.tensor(seq.routing[seq.routed_start : end], dtype=torch.int32)
                .numpy()
                .astype("<i4")
                .tobytes()
            )
            meta["routed_experts"] = base64.b64encode(data).decode()
        if seq.finish is not None:
            meta["e2e_latency"] = time.monotonic() - seq.started
        return {
            "text": self.tokenizer.decode(seq.output_ids),
            "output_ids": list(seq.output_ids),
            "meta_info": meta,
        }

    def log_wire(self, path: str, request: Any, status: int, reply: Any) -> None:
        if self.record is not None:
            self.record.write(
                json.dumps({"path": path, "request": request, "status": status, "reply": reply})
                + "\n"
            )
            self.record.flush()

    # -- control ------------------------------------------------------------------------

    async def abort_all(self, waiting_message: str = "Abort in waiting queue") -> None:
        async with self.cond:
            for seq in list(self.waiting):
                seq.finish = {
                    "type": "abort",
                    "message": waiting_message,
                    "status_code": None,
                    "err_type": None,
                }
                self._finish(seq)
            self.waiting.clear()
            for seq in list(self.running):
                if seq.finish is None:
                    seq.finish = {
                        "type": "abort",
                        "message": "Aborted",
                        "status_code": None,
                        "err_type": None,
                    }
                self._finish(seq)

    def flush(self) -> bool:
        # SGLang's scheduler: only when idle; while it is paused, queued (retracted) requests
        # do not count, running ones (kept in place) do
        if self.running or (self.waiting and not self.scheduler_stopped):
            return False
        self.prefix_cache.clear()
        return True

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:3]}")
        with self.model_lock:
            for name, tensor in tensors.items():
                params[name].data.copy_(tensor.to(params[name].dtype))


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _filter(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p * sorted_probs.sum()
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def _copy_cache(cache: Any) -> Any:
    import copy

    return copy.deepcopy(cache)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def _load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _load_lora(path: str, model: Any) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory as weight deltas (scaling * B @ A) by base parameter name."""
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    tensors = _load_safetensors_dir(path)
    scaling = float(config["lora_alpha"]) / float(config["r"])
    params = dict(model.named_parameters())
    deltas: dict[str, torch.Tensor] = {}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        base = name.split(".lora_A.")[0].removeprefix("base_model.model.") + ".weight"
        if base not in params:
            raise ValueError(f"adapter weight {name} targets {base}, which the model does not have")
        deltas[base] = scaling * (b.float() @ a.float())
    return deltas


def build_app(server: FakeSGLang) -> FastAPI:
    app = FastAPI()
    state = {"ready": False}

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        return json.loads(raw) if raw else {}

    def ok_json(path: str, request_body: Any, content: Any, status: int = 200) -> JSONResponse:
        server.log_wire(path, request_body, status, content)
        return JSONResponse(content, status_code=status)

    def bad(path: str, request_body: Any, message: str, status: int = 400) -> JSONResponse:
        return ok_json(path, request_body, {"error": {"message": message}}, status)

    @app.on_event("startup")
    async def startup() -> None:
        app.state.scheduler = asyncio.create_task(server.run_scheduler())
        asyncio.get_running_loop().call_later(
            server.args.startup_delay, state.update, {"ready": True}
        )

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if state["ready"] else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return ok_json(
            "/model_info",
            None,
            {
                "model_path": server.args.model_path,
                "served_model_name": server.args.model_path,
                "tokenizer_path": server.args.tokenizer_path or server.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": server.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": server.config.model_type,
                "architectures": server.config.architectures,
            },
        )

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        return ok_json(
            "/server_info",
            None,
            {
                "model_path": server.args.model_path,
                "served_model_name": server.args.model_path,
                "tokenizer_path": server.args.tokenizer_path or server.args.model_path,
                "max_context_length": server.args.context_length,
                "version": server.version,
                "internal_states": [{}],
                "host": server.args.host,
                "port": server.args.port,
                "incremental_streaming_output": False,
                "disaggregation_mode": "null",
                "tp_size": 1,
                "dp_size": 1,
                "random_seed": server.args.random_seed,
                "enable_return_routed_experts": server.args.enable_return_routed_experts,
            },
        )

    if server.version in ("0.5.6", "0.5.9"):

        @app.get("/get_weight_version")
        async def get_weight_version() -> JSONResponse:
            return ok_json("/get_weight_version", None, {"weight_version": server.weight_version})
    elif server.version == "0.5.15":

        @app.get("/get_weight_version")
        async def get_weight_version_deprecated() -> JSONResponse:
            return JSONResponse(
                {"detail": "/get_weight_version is deprecated; use /model_info"}, status_code=404
            )

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> JSONResponse:
        body = await body_of(request)
        if server.version == "0.5.23" and (error := contract_error(body)) is not None:
            return ok_json("/generate", body, {"error": error}, 400)
        ids = body.get("input_ids")
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not prompts or any(not isinstance(p, list) or not p for p in prompts):
            return bad(
                "/generate",
                body,
                "The input_ids must be a non-empty list of token ids "
                "(text is not supported by this fake)",
            )
        vocab = server.config.vocab_size
        for prompt in prompts:
            if any(not 0 <= int(t) < vocab for t in prompt):
                bad_id = next(t for t in prompt if not 0 <= int(t) < vocab)
                return bad("/generate", body, f"The input_ids {bad_id} >= vocab_size {vocab}")
        async with server.cond:  # requests block while generation is paused
            await server.cond.wait_for(lambda: not server.is_pause)
            seqs = []
            for i, prompt in enumerate(prompts):
                params = _pick(body.get("sampling_params") or {}, i) or {}
                if int(params.get("n") or 1) != 1:
                    return bad(
                        "/generate", body, "n > 1 is only supported with text input in this fake"
                    )
                seed = params.get("sampling_seed")
                if seed is None:
                    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=server.rng))
                constraints = ("json_schema", "regex", "ebnf", "structural_tag")
                if sum(bool(params.get(k)) for k in constraints) > 1:
                    return bad(
                        "/generate",
                        body,
                        "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
                    )
                rid = _pick(body.get("rid"), i) or uuid.uuid4().hex
                seq = Sequence_(str(rid), [int(t) for t in prompt], params, body, i, int(seed))
                if params.get("ebnf"):  # SGLang reads an empty grammar as none
                    try:
                        seq.grammar = server.grammar_matcher(params["ebnf"])
                    except GrammarError as exc:
                        return bad("/generate", body, f"Failed to compile ebnf grammar: {exc}")
                seqs.append(seq)
            server.waiting.extend(seqs)
            server.cond.notify_all()
        await asyncio.gather(*(s.done for s in seqs))
        # An abort that carries an error status is an HTTP error (SGLang's
        # _handle_abort_finish_reason).
        for seq in seqs:
            finish = seq.finish or {}
            status = finish.get("status_code")
            if isinstance(status, int) and status >= 400:
                return bad("/generate", body, finish["message"], status)
        replies = [server.reply(s) for s in seqs]
        return ok_json("/generate", body, replies if batch else replies[0])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if server.flush():
            text = (
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, "
                "the operation will not be performed.)\n"
            )
            return Response(content=text, status_code=200)
        return Response(content="Flush cache failed.\n", status_code=400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await body_of(request)
        try:
            body = parse_body("PauseGenerationReqInput", raw)
        except ContractError as exc:
            return bad("/pause_generation", raw, str(exc), 422)
        if body["mode"] not in ("abort", "retract", "in_place"):
            return bad("/pause_generation", raw, f"invalid mode {body['mode']!r}", 422)
        async with server.cond:
            server.is_pause = True
            server.pause_mode = body["mode"]
        if body["mode"] == "abort":
            await server.abort_all()
            return ok_json(
                "/pause_generation",
                raw,
                {"message": "Generation paused successfully.", "status": "ok"},
            )
        async with server.iteration:  # the scheduler stops between iterations
            pass
        if body["mode"] == "retract":
            async with server.cond:
                for seq in server.running:
                    if seq.finish is None:
                        seq.cache, seq.next_logits = None, None
                        seq.retractions += 1
                server.waiting.extendleft(reversed(server.running))
                server.running.clear()
        return ok_json(
            "/pause_generation", raw, {"message": "Generation paused successfully.", "status": "ok"}
        )

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        raw = await body_of(request)
        async with server.cond:
            server.is_pause = False
            server.cond.notify_all()
        return ok_json(
            "/continue_generation",
            raw,
            {"message": "Generation continued successfully.", "status": "ok"},
        )

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        raw = await body_of(request)
        body = parse_body("AbortReq", raw)
        if body["abort_all"]:
            await server.abort_all()
        elif body["rid"]:
            async with server.cond:
                for seq in [*server.waiting, *server.running]:
                    if seq.rid.startswith(body["rid"]) and seq.finish is None:
                        seq.finish = {
                            "type": "abort",
                            "message": "Aborted",
                            "status_code": None,
                            "err_type": None,
                        }
                        if seq in server.waiting:
                            server.waiting.remove(seq)
                        server._finish(seq)
        server.log_wire("/abort_request", raw, 200, None)
        return Response(status_code=200)

    def weights_reply(
        path: str, raw: Any, success: bool, message: str, **extra: Any
    ) -> JSONResponse:
        return ok_json(
            path, raw, {"success": success, "message": message, **extra}, 200 if success else 400
        )

    async def after_update(body: dict[str, Any], path: str, raw: Any, **extra: Any) -> JSONResponse:
        if body.get("weight_version") is not None:
            server.weight_version = str(body["weight_version"])
        if body.get("flush_cache") and not server.flush():
            return weights_reply(
                path, raw, False, "Cache flush failed after updating weights", **extra
            )
        return weights_reply(path, raw, True, "Succeeded to update model weights.", **extra)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        raw = await body_of(request)
        try:
            body = parse_body("UpdateWeightFromDiskReqInput", raw)
        except ContractError as exc:
            return bad("/update_weights_from_disk", raw, str(exc), 422)
        if body["abort_all_requests"]:
            await server.abort_all()
        if not server.is_pause:  # the writer lock: wait for running requests
            async with server.cond:
                await server.cond.wait_for(lambda: not server.running and not server.waiting)
        try:
            tensors = await asyncio.to_thread(_load_safetensors_dir, body["model_path"])
            await asyncio.to_thread(server.load_weights, tensors)
        except (OSError, ValueError, RuntimeError) as exc:
            return weights_reply(
                "/update_weights_from_disk",
                raw,
                False,
                f"Failed to update weights: {exc}",
                num_paused_requests=0,
            )
        return await after_update(body, "/update_weights_from_disk", raw, num_paused_requests=0)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        raw = await body_of(request)
        try:
            body = parse_body("InitWeightsUpdateGroupReqInput", raw)
        except ContractError as exc:
            return bad("/init_weights_update_group", raw, str(exc), 422)
        if body["backend"] != "gloo":
            return weights_reply(
                "/init_weights_update_group",
                raw,
                False,
                f"backend {body['backend']!r} needs GPUs; this CPU fake speaks 'gloo'",
            )
        try:
            group = await asyncio.to_thread(_open_gloo_group, body)
        except RuntimeError as exc:
            return weights_reply(
                "/init_weights_update_group", raw, False, f"Failed to init group: {exc}"
            )
        server.groups[body["group_name"]] = group
        return weights_reply(
            "/init_weights_update_group", raw, True, "Succeeded to initialize custom process group."
        )

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        raw = await body_of(request)
        try:
            body = parse_body("UpdateWeightsFromDistributedReqInput", raw)
        except ContractError as exc:
            return bad("/update_weights_from_distributed", raw, str(exc), 422)
        group = server.groups.get(body["group_name"])
        if group is None:
            return weights_reply(
                "/update_weights_from_distributed",
                raw,
                False,
                f"Group {body['group_name']} not in the process groups",
            )
        if body["abort_all_requests"]:
            await server.abort_all()
        try:
            tensors = await asyncio.to_thread(
                _receive, group, body["names"], body["dtypes"], body["shapes"]
            )
            await asyncio.to_thread(server.load_weights, tensors)
        except (RuntimeError, ValueError) as exc:
            return weights_reply(
                "/update_weights_from_distributed", raw, False, f"Failed to update weights: {exc}"
            )
        return await after_update(body, "/update_weights_from_distributed", raw)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        raw = await body_of(request)
        body = parse_body("DestroyWeightsUpdateGroupReqInput", raw)
        if server.groups.pop(body["group_name"], None) is None:
            return weights_reply(
                "/destroy_weights_update_group", raw, False, f"Group {body['group_name']} not found"
            )
        return weights_reply(
            "/destroy_weights_update_group", raw, True, "Succeeded to destroy custom process group."
        )

    if server.version == "0.5.23":

        @app.post("/begin_weight_update")
        @app.post("/end_weight_update")
        async def weight_update_session(request: Request) -> JSONResponse:
            raw = await body_of(request)
            return weights_reply(request.url.path, raw, True, "Success")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        raw = await body_of(request)
        try:
            body = parse_body("UpdateWeightVersionReqInput", raw)
        except ContractError as exc:
            return bad("/update_weight_version", raw, str(exc), 422)
        if body["abort_all_requests"]:
            await server.abort_all()
        server.weight_version = str(body["new_version"])
        return ok_json(
            "/update_weight_version",
            raw,
            {
                "success": True,
                "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"],
            },
        )

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        raw = await body_of(request)
        try:
            body = parse_body("LoadLoRAAdapterReqInput", raw)
            if not server.args.enable_lora:
                raise ValueError(
                    "LoRA is not enabled. Please set `--enable-lora` to load LoRA adapters."
                )
            deltas = await asyncio.to_thread(_load_lora, body["lora_path"], server.model)
        except (ContractError, ValueError, OSError, KeyError) as exc:
            return ok_json(
                "/load_lora_adapter",
                raw,
                {
                    "rid": None,
                    "http_worker_ipc": None,
                    "success": False,
                    "error_message": str(exc),
                    "loaded_adapters": None,
                },
                400,
            )
        server.loras[body["lora_name"]] = deltas
        return ok_json(
            "/load_lora_adapter",
            raw,
            {
                "rid": None,
                "http_worker_ipc": None,
                "success": True,
                "error_message": None,
                "loaded_adapters": _adapters(server),
            },
        )

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        raw = await body_of(request)
        body = parse_body("UnloadLoRAAdapterReqInput", raw)
        if server.loras.pop(body["lora_name"], None) is None:
            return ok_json(
                "/unload_lora_adapter",
                raw,
                {
                    "rid": None,
                    "http_worker_ipc": None,
                    "success": False,
                    "error_message": f"LoRA adapter {body['lora_name']} is not loaded",
                    "loaded_adapters": None,
                },
                400,
            )
        return ok_json(
            "/unload_lora_adapter",
            raw,
            {
                "rid": None,
                "http_worker_ipc": None,
                "success": True,
                "error_message": None,
                "loaded_adapters": _adapters(server),
            },
        )

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation() -> JSONResponse:
        return JSONResponse(None)

    return app


def _adapters(server: FakeSGLang) -> dict[str, str]:
    return {name: name for name in server.loras}


def _open_gloo_group(body: dict[str, Any]) -> Any:
    """The engine's member of the broadcast group (plait's rendezvous,
    `plait_weights.broadcast`)."""
    from plait_weights.broadcast import open_group
    from plait_weights.capabilities import BroadcastGroup

    group = BroadcastGroup(
        body["master_address"],
        int(body["master_port"]),
        int(body["rank_offset"]),
        int(body["world_size"]),
        body["backend"],
        body["group_name"],
    )
    return open_group(group, int(body["rank_offset"]))


def _receive(
    group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    tensors = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        group.broadcast([tensor], options).wait()
        tensors[name] = tensor
    return tensors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int)
    parser.add_argument("--max-loras-per-batch", type=int)
    parser.add_argument("--lora-target-modules", nargs="*")
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--api-key")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--fake-version", default="0.5.23", choices=VERSIONS)
    parser.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        help="answer /health with 503 for this long after start (tests of the health wait)",
    )
    parser.add_argument("--record", help="append every request and reply to this JSONL file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.random_seed)
    server = FakeSGLang(args)
    uvicorn.run(
        build_app(server),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=2,
    )


if __name__ == "__main__":
    main()
