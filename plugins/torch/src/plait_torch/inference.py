"""The "torch" inference engine: batched sampling with a KV cache, in-process.

How it runs:

- `sample()` queues a request and awaits it. A scheduler task waits until the queue stops
  growing (no new request for a few event-loop turns and `options.batch_wait_ms`), then takes
  every queued request (up to `options.max_batch_size` sequences; a request's n samples always
  share a batch) and decodes them together; requests that arrive while a batch runs go into the
  next one.
- A batch is one prefill of the distinct prompts (left-padded; with `options.prefix_sharing`, the
  tokens they all start with run once first), whose KV cache is then repeated for the n samples of
  each prompt, followed by one decode step per token. Each step runs in the engine's one worker
  thread (always the same thread: torch's CPU thread pool is per calling thread, and pools of
  several threads spinning at once take each other's cores), so the event loop stays free;
  between steps the scheduler checks for pause, abort and weight updates. Finished sequences
  leave the batch at once; a request returns as soon as all of its samples are done.
- Randomness: every sample has its own generator, seeded from the request's seed (or from the
  engine's seed when the request has none) and the sample's index, and draws one uniform number
  per token. Same seed + same weights -> same tokens, whatever else shares the batch (up to
  floating-point noise in the logits, which can flip a draw that lands within ~1e-6 of a
  boundary).
- Logprobs are those of the sampled token under the raw model distribution (temperature 1,
  before top-k/top-p), like vLLM's default, so they match the trainer's forward on the same
  weights.
- Stops: `SamplingParams.stop` None = the model's end-of-sequence token(s); [] = none; token ids
  or strings otherwise (they replace the end-of-sequence default). Returned tokens include the
  stop token; a stop string stops after the token that completes it.
- Grammars (`SamplingParams.grammar`, GBNF): every step masks each constrained row's logits to the
  tokens its grammar allows (llguidance, `plait_hf.grammar_mask`); stop tokens are allowed only
  where the grammar accepts, and are all that is left once it can take nothing more (with no stop
  tokens, the sequence then ends with stop reason "stop"). Logprobs stay the raw model's.
- Weight versions: every token is tagged with the version of the weights that produced it.
  `apply_weights` takes effect between two decode steps, also for sequences in flight. It takes
  full updates and delta updates (sparse patches, `plait_weights.patch`; a delta must be made in
  the dtype the engine serves, and it applies only to its base version and bits); when the update
  carries a checksum, the engine checks its weights against it afterwards and raises on a mismatch.
- `pause("keep")` parks the running batch between steps (its KV cache kept) until `resume()`;
  tokens decoded after a weight update in between carry the new version. `pause("abort")` ends
  queued and running requests with what they have (stop reason "abort"). `pause("wait")` lets the
  running batch finish. In every mode, requests sent while paused wait for `resume()`.
- `options.dtype` = the dtype to sample in (None = model.dtype).
- Routing replay (`options.enable_return_routed_experts`, mixture-of-experts models only):
  forward hooks on the routers record the top-k experts of every token the engine runs (each
  distinct prompt's real positions in the prefill, then each row's fed token per decode step).
  `SampledSequence.routed_experts` is (len(prompt) + len(tokens) - 1, layers, top_k), vLLM's
  convention: every prompt token and every sampled token but the last (never fed). An aborted
  sample follows the same rule: with k tokens it has prompt + k - 1 rows (the prefill always
  yields a first token, so k >= 1 once a sample has run); a request aborted while still queued
  ran nothing, has no tokens and None. (plait's rollout re-requests an aborted sample with
  prompt + tokens as its prompt and keeps the continuation's routing alone.)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs
import numpy as np
import structlog
import torch

from plait.api import (
    ConfigError,
    DataError,
    EngineError,
    EngineHealth,
    ModelInput,
    PauseMode,
    ResolvedModel,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TensorData,
    WeightUpdate,
    prompt_token_ids,
)
from plait_hf.grammar_mask import GrammarError, GrammarMatcher, GrammarVocabulary
from plait_torch.options import TorchInferenceOptions
from plait_torch.sampling import RowParams, choose_tokens
from plait_train import loading
from plait_train.layout import common_prefix
from plait_train.lora import merge_adapter
from plait_train.ops import target_logprobs
from plait_train.routing import RoutingHooks, moe_shape
from plait_weights import patch as weight_patch
from plait_weights.delta import WeightBaseError

log = structlog.get_logger("plait_torch.inference")

T = TypeVar("T")
_SEED_MASK = (1 << 63) - 1
# Event-loop turns without a new request after which the queue counts as complete.
QUEUE_SETTLE_TURNS = 4
# Shorter common prefixes cost more as a pass of their own than they save.
MIN_SHARED_PREFIX = 16
# Tokens of one compute_logprobs pass after a shared prefix, which bound its full logits (tokens x
# vocab, float32): 0.4 GB at SmolLM2's 49k vocabulary, 1.2 GB at Qwen3's 152k.
SCORE_TOKENS = 2048


def cache_keyword(model: Any) -> str:
    """The name under which `model`'s forward takes its KV cache: transformers renamed it from
    `past_key_values` to `cache` (5.25 takes both; 5.17, on the lent GPU machines, only the old
    one, and silently ignores `cache`: every decode step would then run without the prompt)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def derive_seed(seed: int, index: int) -> int:
    """The generator seed of sample `index` of a request seeded with `seed`."""
    return (
        int(np.random.SeedSequence([seed & _SEED_MASK, index]).generate_state(1, np.uint64)[0])
        & _SEED_MASK
    )


@attrs.define(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    future: asyncio.Future[SampleResponse]
    rows: list[_Row] = attrs.field(factory=list)

    @property
    def done(self) -> bool:
        return all(row.stop_reason is not None for row in self.rows)

    def response(self, current_version: int) -> SampleResponse:
        """The result; a sample without tokens is tagged with `current_version`."""
        return SampleResponse(
            [
                SampledSequence(
                    row.tokens,
                    row.logprobs,
                    row.stop_reason or "abort",
                    weight_version=row.versions[-1] if row.versions else current_version,
                    token_versions=row.versions,
                    routed_experts=self._routing(row),
                    top_logprobs=tuple(row.top_logprobs) if self.params.top_logprobs else None,
                )
                for row in self.rows
            ]
        )

    def _routing(self, row: _Row) -> TensorData | None:
        """Rows of every token fed but the last sampled one: prompt + tokens - 1 (see the module
        doc)."""
        if not row.routing:  # not recording, or aborted before its prefill ran
            return None
        routing = np.concatenate(row.routing)
        return TensorData.compact(routing[: max(len(self.prompt) + len(row.tokens) - 1, 0)])


@attrs.define(eq=False)
class _Row:
    """One sequence being sampled."""

    request: _Request
    generator: torch.Generator
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = attrs.field(factory=list)
    stop_reason: StopReason | None = None
    text_checked: int = 0  # characters of decoded text already searched for stop strings
    grammar: GrammarMatcher | None = None  # where the row stands in SamplingParams.grammar
    # (fed tokens, layers, top_k) chunks, when recorded
    routing: list[np.ndarray] = attrs.field(factory=list)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))


@attrs.define(eq=False)
class _Batch:
    requests: list[_Request]
    rows: list[_Row]  # the unfinished rows, in KV-cache order
    cache: Any = None
    attention_mask: torch.Tensor | None = None  # (B, past) long
    positions: torch.Tensor | None = None  # (B,) position id of the next token to feed
    last_tokens: torch.Tensor | None = None  # (B,) the token to feed next
    params: RowParams | None = None


class TorchInferenceEngine:
    """`plait.protocols.InferenceEngine` on PyTorch + transformers, in this process."""

    def __init__(
        self, model: ResolvedModel, *, options: TorchInferenceOptions | None = None, seed: int = 0
    ) -> None:
        self.options = options or TorchInferenceOptions()
        self.model_info = model
        loading.set_threads(self.options.threads)
        self.device = loading.select_device(self.options.device)
        self.tokenizer = loading.load_tokenizer(model.tokenizer_path)
        self.dtype = (
            loading.DTYPES[self.options.dtype] if self.options.dtype else loading.model_dtype(model)
        )
        self.model = loading.load_causal_lm(
            model,
            dtype=self.dtype,
            device=self.device,
            attn_implementation=self.options.attn_implementation,
        )
        loading.check_tokenizer_fits(self.tokenizer, self.model, model)
        self.model.eval().requires_grad_(False)
        # A prefill keeps only the last position before the output projection (logits_to_keep=1):
        # a strided view, for which CPU bfloat16 matmul copies the whole projection (152k x H) per
        # row (seconds per prefill, measured); contiguous rows take the direct path (milliseconds).
        self.model.get_output_embeddings().register_forward_pre_hook(
            lambda _module, args: (args[0].contiguous(), *args[1:])
        )
        if self.options.adapter is not None:
            merge_adapter(self.model, self.options.adapter)
        self._hooks: RoutingHooks | None = None
        if self.options.enable_return_routed_experts:
            shape = moe_shape(self.model)
            if shape is None:
                raise ConfigError(
                    "inference.options.enable_return_routed_experts",
                    f"model {model.name!r} is not a mixture of experts (no top-k router)",
                    fix="turn enable_return_routed_experts off for dense models",
                )
            self._hooks = RoutingHooks(self.model)
            # Expert ids travel from the device once per step, in the narrowest dtype that holds
            # them.
            self._routing_dtype = torch.uint8 if shape.experts <= 256 else torch.int32
        self.vocab_rows = loading.embedding_rows(self.model)
        self._cache_keyword = cache_keyword(self.model)
        self.eos_ids = self._eos_ids()
        self._grammar_vocabulary: GrammarVocabulary | None = None  # built on the first grammar
        self.max_model_len = self.options.max_model_len or int(
            getattr(self.model.config, "max_position_embeddings", 0) or 4096
        )
        self._required = dict(self.model.named_parameters())
        self._aliases = dict(self.model.named_parameters(remove_duplicate=False))
        self._version = 0
        self._rng = random.Random(seed)
        self._queue: collections.deque[_Request] = collections.deque()
        # compute_logprobs calls waiting for a pass, and the passes running (`_score_waiting`)
        self._scoring: list[tuple[list[int], asyncio.Future[list[float]]]] = []
        self._scoring_tasks: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._closed = False
        self._paused = False
        self._pause_mode: PauseMode = "keep"
        self._abort_running = False
        self._batch_active = False
        self._parked = False
        self._failure: BaseException | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="plait-torch-inference"
        )
        log.info(
            "inference engine ready",
            model=model.name,
            device=str(self.device),
            max_model_len=self.max_model_len,
        )

    # -- protocol ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        self._bind()
        request = self._make_request(prompt, num_samples, sampling_params)
        async with self._cond:
            self._queue.append(request)
            self._cond.notify_all()
        return await request.future

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        self._bind()
        ids = self._prompt_ids(prompt)
        if len(ids) > self.max_model_len:
            raise DataError(
                f"prompt of {len(ids)} tokens exceeds max_model_len {self.max_model_len}",
                fix="shorten the prompt or raise inference.options.max_model_len",
            )
        future: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._scoring.append((ids, future))
        if len(self._scoring) == 1:  # the first to wait starts a pass; later ones join it
            task = asyncio.ensure_future(self._score_waiting())
            self._scoring_tasks.add(task)
            task.add_done_callback(self._scoring_tasks.discard)
        return [None, *await future]

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        self._bind()
        async with self._cond:
            self._paused = True
            self._pause_mode = mode
            if mode == "abort":
                while self._queue:  # not started yet: each sample ends empty
                    request = self._queue.popleft()
                    for row in request.rows:
                        row.stop_reason = "abort"
                    request.future.set_result(request.response(self._version))
                self._abort_running = self._batch_active
            self._cond.notify_all()
            if mode == "keep":
                await self._cond.wait_for(lambda: not self._batch_active or self._parked)
            else:
                await self._cond.wait_for(lambda: not self._batch_active)
            self._abort_running = False

    async def resume(self) -> None:
        self._bind()
        async with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def apply_weights(self, update: WeightUpdate) -> None:
        self._bind()
        async with self._model_lock:
            if update.kind == "delta":
                await self._compute(self._patch_weights, update)
            else:
                await self._compute(self._load_weights, update.tensors)
                self._verify(update)
            self._version = int(update.version)
        log.debug(
            "weights applied", version=update.version, kind=update.kind, tensors=len(update.tensors)
        )

    async def health(self) -> EngineHealth:
        if self._closed:
            return EngineHealth(False, self._version, "closed")
        if self._failure is not None:
            return EngineHealth(False, self._version, f"scheduler failed: {self._failure!r}")
        state = "paused" if self._paused else "running"
        return EngineHealth(True, self._version, f"{state}; queued requests: {len(self._queue)}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._scheduler is not None and not self._scheduler.done():
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
        while self._queue:
            _fail(self._queue.popleft(), EngineError("the inference engine was closed"))
        for task in list(self._scoring_tasks):  # its calls fail as closed
            task.cancel()
        await asyncio.gather(*self._scoring_tasks, return_exceptions=True)
        self._worker.shutdown(wait=False)

    async def _score_waiting(self) -> None:
        """Score every prompt waiting for `compute_logprobs`, together: calls that arrive while
        the model is busy wait for the next pass, so concurrent callers (a run scoring each
        episode for its KL reference as it ends) share forward passes. A failure fails every
        call of the pass; cancelled, its calls are too (they fail as closed on `close`)."""
        waiting: list[tuple[list[int], asyncio.Future[list[float]]]] = []
        try:
            async with self._model_lock:
                waiting, self._scoring = self._scoring, []
                scored = await self._compute(self._prompt_logprobs, [ids for ids, _ in waiting])
        except BaseException as exc:
            if not waiting:  # cancelled before it took the calls: they go with it
                waiting, self._scoring = self._scoring, []
            failure = EngineError("the inference engine was closed") if self._closed else exc
            for _, future in waiting:
                if future.done():
                    continue
                if isinstance(failure, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(failure)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return  # the callers raise it
        for (_, future), values in zip(waiting, scored, strict=True):
            if not future.done():
                future.set_result(values)

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # -- requests ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: ModelInput) -> list[int]:
        return prompt_token_ids(prompt, self.vocab_rows)

    def _make_request(
        self, prompt: ModelInput, num_samples: int, params: SamplingParams
    ) -> _Request:
        ids = self._prompt_ids(prompt)
        if num_samples < 1:
            raise DataError(f"num_samples must be >= 1, got {num_samples}")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise DataError(
                f"prompt of {len(ids)} tokens leaves no room "
                f"under max_model_len {self.max_model_len}",
                fix="shorten the prompt or raise inference.options.max_model_len",
            )
        stop_ids, stop_strings = self._stops(params.stop)
        max_tokens = min(params.max_tokens or room, room)
        loop = asyncio.get_running_loop()  # the engine's: every caller has just bound to it
        request = _Request(ids, params, max_tokens, stop_ids, stop_strings, loop.create_future())
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request.rows = [
            _Row(
                request,
                torch.Generator().manual_seed(derive_seed(base_seed, i)),
                grammar=None if params.grammar is None else self._grammar_matcher(params.grammar),
            )
            for i in range(num_samples)
        ]
        return request

    def _grammar_matcher(self, grammar: str) -> GrammarMatcher:
        if self._grammar_vocabulary is None:
            self._grammar_vocabulary = GrammarVocabulary(self.tokenizer, self.vocab_rows)
        try:
            return self._grammar_vocabulary.matcher(grammar)
        except GrammarError as exc:
            raise DataError(
                f"SamplingParams.grammar: {exc}",
                fix="give a GBNF grammar (xgrammar's EBNF dialect) with a `root` rule",
            ) from None

    def _stops(self, stop: Any) -> tuple[frozenset[int], tuple[str, ...]]:
        if stop is None:
            return self.eos_ids, ()
        if isinstance(stop, str):
            return frozenset(), (stop,)
        items = tuple(stop)
        if all(isinstance(s, str) for s in items):
            if any(not s for s in items):
                raise DataError("SamplingParams.stop contains an empty string", fix="remove it")
            return frozenset(), items
        if all(isinstance(s, int | np.integer) and not isinstance(s, bool) for s in items):
            return frozenset(int(s) for s in items), ()
        raise DataError(
            f"SamplingParams.stop mixes strings and token ids: {items!r}",
            fix="give either stop strings or stop token ids",
        )

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (
            getattr(self.model, "generation_config", None),
            self.model.config,
            self.tokenizer,
        ):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, Iterable):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # -- scheduling -------------------------------------------------------------------------

    def _bind(self) -> None:
        """Attach to the running event loop (again, when a previous loop has gone away)."""
        if self._closed:
            raise EngineError("the inference engine is closed", fix="build a new engine")
        if self._failure is not None:
            raise EngineError(
                f"the inference engine's scheduler failed: {self._failure!r}",
                fix="build a new engine (and report the failure)",
            )
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if (
            self._loop is not None
            and not self._loop.is_closed()
            and (self._queue or self._batch_active)
        ):
            raise EngineError(
                "this inference engine is busy in another event loop",
                fix="use one engine from one event loop at a time",
            )
        self._loop = loop
        self._queue.clear()
        self._batch_active = self._parked = self._abort_running = False
        self._cond = asyncio.Condition()
        self._model_lock = asyncio.Lock()
        self._scoring = []
        self._scoring_tasks = set()
        self._scheduler = loop.create_task(self._schedule(), name="plait-torch-scheduler")

    async def _schedule(self) -> None:
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(lambda: bool(self._queue) and not self._paused)
                await self._let_the_queue_fill()
                async with self._cond:
                    if not self._queue or self._paused:
                        continue
                    requests = self._take_batch()
                    self._batch_active = True
                try:
                    await self._run_batch(requests)
                except asyncio.CancelledError:
                    for request in requests:
                        _fail(request, EngineError("the inference engine was closed"))
                    raise
                except Exception as exc:  # a failed batch fails its requests, not the engine
                    log.exception("batch failed", requests=len(requests))
                    for request in requests:
                        _fail(request, exc)
                finally:
                    async with self._cond:
                        self._batch_active = self._parked = False
                        self._cond.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
            while self._queue:  # nobody would serve them: fail them rather than leave them hanging
                _fail(
                    self._queue.popleft(),
                    EngineError(f"the inference engine's scheduler failed: {exc!r}"),
                )
            raise

    async def _let_the_queue_fill(self) -> None:
        """Requests sent together (a step's episodes) reach the queue over several event-loop
        turns and, when their environments run user code in threads, over milliseconds: wait until
        it stops growing, so they share one batch rather than the first few decoding alone while
        the rest wait a whole batch for them."""
        quiet_s = self.options.batch_wait_ms / 1000
        rows, still, since = -1, 0, time.perf_counter()
        while still < QUEUE_SETTLE_TURNS or time.perf_counter() - since < quiet_s:
            queued = sum(len(request.rows) for request in self._queue)
            if queued >= self.options.max_batch_size:
                return
            if queued != rows:
                rows, still, since = queued, 0, time.perf_counter()
            else:
                still += 1
            # Turns first (they cost nothing); then short sleeps, so threads get the GIL.
            await asyncio.sleep(0 if still < QUEUE_SETTLE_TURNS else 0.001)

    def _take_batch(self) -> list[_Request]:
        requests = [self._queue.popleft()]
        rows = len(requests[0].rows)
        while self._queue and rows + len(self._queue[0].rows) <= self.options.max_batch_size:
            rows += len(self._queue[0].rows)
            requests.append(self._queue.popleft())
        return requests

    async def _run_batch(self, requests: list[_Request]) -> None:
        batch = _Batch(requests, [row for request in requests for row in request.rows])
        async with self._model_lock:
            await self._compute(self._prefill, batch, self._version)
        self._resolve(batch)
        while batch.rows:
            if not await self._gate(batch):
                return
            async with self._model_lock:
                await self._compute(self._decode_step, batch, self._version)
            self._resolve(batch)

    async def _gate(self, batch: _Batch) -> bool:
        """Between two decode steps: park while paused ("keep"), end the batch on abort."""
        async with self._cond:
            while self._paused and self._pause_mode != "wait":
                if self._abort_running:
                    for row in batch.rows:
                        row.stop_reason = "abort"
                    batch.rows = []
                    self._resolve(batch)
                    return False
                self._parked = True
                self._cond.notify_all()
                await self._cond.wait()
            self._parked = False
        return True

    def _resolve(self, batch: _Batch) -> None:
        for request in batch.requests:
            if request.future.done():
                if request.future.cancelled():  # the caller went away: stop decoding its rows
                    for row in request.rows:
                        row.stop_reason = row.stop_reason or "abort"
                continue
            if request.done:
                request.future.set_result(request.response(self._version))

    # -- compute (worker thread) ------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, batch: _Batch, version: int) -> None:
        # One prefill per distinct prompt (the samples of a group usually share theirs); its KV
        # cache is then repeated for every sample of that prompt. The tokens every distinct prompt
        # starts with run once before the rest (prefix_sharing).
        distinct: dict[tuple[int, ...], int] = {}
        for row in batch.rows:
            distinct.setdefault(tuple(row.request.prompt), len(distinct))
        prompts = list(distinct)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        shared = self._shared_prefix(prompts)
        routed_prefix: list[np.ndarray] = []
        if shared:
            self.model(
                input_ids=torch.tensor([prompts[0][:shared]], device=self.device),
                **{self._cache_keyword: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            if self._hooks is not None:
                routed_prefix.append(self._routed_experts())
            prefix_row_for_each_prompt = torch.zeros(
                len(prompts), dtype=torch.long, device=self.device
            )
            # transformers annotates the index as torch.LongTensor, which torch's factories never
            # return (they return Tensor, whatever the dtype)
            cache.reorder_cache(prefix_row_for_each_prompt)  # type: ignore[arg-type]
        rests = [prompt[shared:] for prompt in prompts]
        width = max(len(rest) for rest in rests)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), shared + width, dtype=torch.long)
        mask[:, :shared] = 1
        for i, rest in enumerate(rests):  # left padding: every prompt ends at the last column
            ids[i, width - len(rest) :] = torch.tensor(rest)
            mask[i, shared + width - len(rest) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions[:, shared:],
            **{self._cache_keyword: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        if self._hooks is not None:
            # each prompt's real (right-aligned) positions; samples share them
            routed = self._routed_experts()
            routed = routed.reshape(len(prompts), width, *routed.shape[1:])
            per_prompt = [
                np.concatenate([*routed_prefix, routed[i, width - len(rest) :]])
                for i, rest in enumerate(rests)
            ]
            for row in batch.rows:
                row.routing = [per_prompt[distinct[tuple(row.request.prompt)]]]
        expand = torch.tensor(
            [distinct[tuple(row.request.prompt)] for row in batch.rows], device=self.device
        )
        cache.reorder_cache(expand)  # type: ignore[arg-type]  # torch.LongTensor again, as above
        batch.cache = cache
        batch.attention_mask = mask[expand]
        batch.positions = positions[expand, -1] + 1
        rows = batch.rows
        batch.params = RowParams(
            temperature=torch.tensor(
                [r.request.params.temperature for r in rows], device=self.device
            ),
            top_k=torch.tensor([max(r.request.params.top_k, 0) for r in rows], device=self.device),
            top_p=torch.tensor([r.request.params.top_p for r in rows], device=self.device),
        )
        self._emit(batch, out.logits[:, -1][expand], version)

    def _shared_prefix(self, prompts: list[tuple[int, ...]]) -> int:
        """Tokens every prompt starts with, worth a pass of their own (0 = none); each prompt keeps
        at least its last token for the pass that yields its first sample."""
        if not self.options.prefix_sharing or len(prompts) < 2:
            return 0
        first = np.asarray(prompts[0])
        shared = min(
            min(len(p) for p in prompts) - 1,
            *(common_prefix(first, np.asarray(p)) for p in prompts[1:]),
        )
        return shared if shared >= MIN_SHARED_PREFIX else 0

    @torch.inference_mode()
    def _decode_step(self, batch: _Batch, version: int) -> None:
        # _prefill set these
        assert batch.attention_mask is not None and batch.positions is not None
        assert batch.last_tokens is not None
        batch.attention_mask = torch.cat(
            [batch.attention_mask, batch.attention_mask.new_ones(len(batch.rows), 1)], dim=1
        )
        out = self.model(
            input_ids=batch.last_tokens.unsqueeze(-1),
            attention_mask=batch.attention_mask,
            position_ids=batch.positions.unsqueeze(-1),
            **{self._cache_keyword: batch.cache},
            use_cache=True,
        )
        if self._hooks is not None:  # one token per row, in batch order
            routed = self._routed_experts()
            for i, row in enumerate(batch.rows):
                row.routing.append(routed[i : i + 1])
        batch.positions = batch.positions + 1
        self._emit(batch, out.logits[:, -1], version)

    def _routed_experts(self) -> np.ndarray:
        """(flat tokens, layers, top_k) experts of the last forward pass, on the host."""
        assert self._hooks is not None
        return self._hooks.stacked(self._hooks.chosen).to(self._routing_dtype).cpu().numpy()

    def _emit(self, batch: _Batch, logits: torch.Tensor, version: int) -> None:
        """Choose every row's next token, record it, and drop the rows that finished."""
        assert batch.params is not None  # _prefill set it
        uniforms = torch.tensor([row.uniform() for row in batch.rows], device=self.device)
        tokens, logprobs = choose_tokens(logits, batch.params, uniforms, self._allowed(batch))
        top = self._top_logprobs(batch, logits)
        for i, (row, token, logprob) in enumerate(
            zip(batch.rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if row.stop_reason is not None:  # cancelled by its caller between steps
                continue
            row.tokens.append(token)
            row.logprobs.append(logprob)
            if top is not None and row.request.params.top_logprobs:
                row.top_logprobs.append(top[i][: row.request.params.top_logprobs])
            row.versions.append(version)
            if row.grammar is not None and token not in row.request.stop_ids:
                row.grammar.advance(token)
            row.stop_reason = self._stop_reason(row, token)
        keep = [i for i, row in enumerate(batch.rows) if row.stop_reason is None]
        if len(keep) < len(batch.rows):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            batch.rows = [batch.rows[i] for i in keep]
            if keep:
                assert batch.attention_mask is not None and batch.positions is not None
                batch.cache.reorder_cache(index)
                batch.attention_mask = batch.attention_mask[index]
                batch.positions = batch.positions[index]
                batch.params = RowParams(
                    batch.params.temperature[index],
                    batch.params.top_k[index],
                    batch.params.top_p[index],
                )
            tokens = tokens[index]
        batch.last_tokens = tokens

    def _top_logprobs(
        self, batch: _Batch, logits: torch.Tensor
    ) -> list[tuple[tuple[int, float], ...]] | None:
        """Each row's most likely next tokens with their raw logprobs, as many as the row that
        asks for most wants; None when no row asks."""
        k = max(row.request.params.top_logprobs for row in batch.rows)
        if not k:
            return None
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return [
            tuple(zip(row_ids, row_values, strict=True))
            for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
        ]

    def _allowed(self, batch: _Batch) -> torch.Tensor | None:
        """(B, V) the tokens each row may choose, None when no row has a grammar."""
        if all(row.grammar is None for row in batch.rows):
            return None
        allowed = np.ones((len(batch.rows), self.vocab_rows), dtype=bool)
        for i, row in enumerate(batch.rows):
            if row.grammar is not None:
                allowed[i] = row.grammar.allowed(row.request.stop_ids)
        return torch.from_numpy(allowed).to(self.device)

    def _stop_reason(self, row: _Row, token: int) -> StopReason | None:
        request = row.request
        if token in request.stop_ids:
            return "stop"
        if row.grammar is not None and row.grammar.complete and not request.stop_ids:
            return "stop"  # the grammar is done and no stop token would end the text
        if request.stop_strings and self._hit_stop_string(row):
            return "stop"
        if len(row.tokens) >= request.max_tokens:
            return "length"
        return None

    def _hit_stop_string(self, row: _Row) -> bool:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=False)
        longest = max(len(s) for s in row.request.stop_strings)
        start = max(0, row.text_checked - longest)
        row.text_checked = len(text)
        return any(s in text[start:] for s in row.request.stop_strings)

    @torch.inference_mode()
    def _prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's logprob of every token after the first. Sorted, prompts that start alike
        (the samples of one task) are neighbours; a neighbour joins the pass before it while
        that costs no more tokens than a pass of its own and the pass stays within SCORE_TOKENS
        past the prefix its prompts share, which runs once (`_score_together`), and within
        `max_batch_size` rows."""
        order = sorted(range(len(prompts)), key=lambda i: prompts[i])
        scored: dict[int, list[float]] = {}
        start = 0
        while start < len(order):
            end = start + 1
            cost, _ = self._pass_tokens(prompts, order[start:end])
            while end < len(order):
                total, padded = self._pass_tokens(prompts, order[start : end + 1])
                rows = end + 1 - start  # each holds a copy of the prefix's KV cache
                if rows > self.options.max_batch_size or padded > SCORE_TOKENS:
                    break
                if total > cost + len(prompts[order[end]]):
                    break
                cost, end = total, end + 1
            together = [prompts[i] for i in order[start:end]]
            for index, values in zip(order[start:end], self._score_together(together), strict=True):
                scored[index] = values
            start = end
        return [scored[i] for i in range(len(prompts))]

    def _pass_tokens(self, prompts: list[list[int]], members: list[int]) -> tuple[int, int]:
        """The tokens a pass over `members` of `prompts` runs: in all, and after their shared
        prefix (padded)."""
        tuples = [tuple(prompts[i]) for i in members]
        shared = self._shared_prefix(tuples)
        after = len(tuples) * (max(map(len, tuples)) - shared)
        return shared + after, after

    def _score_together(self, prompts: list[list[int]]) -> list[list[float]]:
        """One right-padded pass over `prompts` after the prefix they share (`_shared_prefix`),
        which runs first, once, its KV cache repeated for every prompt."""
        from transformers import DynamicCache

        shared = self._shared_prefix([tuple(p) for p in prompts])
        cache = DynamicCache(config=self.model.config)
        head: list[float] = []
        if shared:
            prefix = torch.tensor([prompts[0][:shared]], device=self.device)
            out = self.model(input_ids=prefix, **{self._cache_keyword: cache}, use_cache=True)
            head = target_logprobs(out.logits[0, :-1], prefix[0, 1:]).tolist()
            # the first token after the prefix, scored by the prefix's last position
            firsts = torch.tensor([p[shared] for p in prompts], device=self.device)
            first = target_logprobs(out.logits[0, -1].expand(len(prompts), -1), firsts).tolist()
            repeat = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
            cache.reorder_cache(repeat)  # type: ignore[arg-type]  # torch.LongTensor, see _prefill
        rests = [p[shared:] for p in prompts]
        width = max(map(len, rests))
        ids = torch.zeros((len(rests), width), dtype=torch.long, device=self.device)
        mask = torch.ones((len(rests), shared + width), dtype=torch.long, device=self.device)
        for row, rest in enumerate(rests):
            ids[row, : len(rest)] = torch.tensor(rest, device=self.device)
            mask[row, shared + len(rest) :] = 0
        positions = torch.arange(shared, shared + width, device=self.device).expand(len(rests), -1)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **({self._cache_keyword: cache} if shared else {}),
            use_cache=bool(shared),
        ).logits
        values = target_logprobs(logits[:, :-1], ids[:, 1:])
        return [
            [*head, *([first[row]] if shared else []), *values[row, : len(rest) - 1].tolist()]
            for row, rest in enumerate(rests)
        ]

    @torch.no_grad()
    def _load_weights(self, tensors: Mapping[str, Any]) -> None:
        unknown = sorted(set(tensors) - set(self._aliases))
        if unknown:
            raise EngineError(
                f"weight update names {len(unknown)} unknown parameters, e.g. {unknown[:3]}",
                fix="export weights from a trainer of the same model (Hugging Face names)",
            )
        covered = {id(self._aliases[name]) for name in tensors}
        missing = sorted(name for name, param in self._required.items() if id(param) not in covered)
        if missing:
            raise EngineError(
                f"full weight update lacks {len(missing)} parameters, e.g. {missing[:3]}",
                fix="send every parameter the trainer exports",
            )
        sources = {name: _as_tensor(value) for name, value in tensors.items()}
        for name, source in sources.items():
            if tuple(source.shape) != tuple(self._aliases[name].shape):
                raise EngineError(
                    f"weight {name!r} has shape {tuple(source.shape)}, the model's is "
                    f"{tuple(self._aliases[name].shape)}",
                    fix="export weights from a trainer of the same model",
                )
        for name, source in sources.items():
            self._aliases[name].copy_(source)

    @torch.no_grad()
    def _patch_weights(self, update: WeightUpdate) -> None:
        """Write the elements a delta update names (plait_weights.patch), then check the
        checksum."""
        try:
            weight_patch.apply_update(self._aliases, update, held_version=self._version)
        except WeightBaseError as exc:
            raise EngineError(exc.message, fix=exc.fix) from exc
        except ValueError as exc:
            raise EngineError(
                f"delta weight update {update.version} does not apply: {exc}",
                fix="set sync.options.dtype to the dtype this engine serves "
                f"({weight_patch.dtype_name(self.dtype)}), and resend full weights",
            ) from exc

    def _verify(self, update: WeightUpdate) -> None:
        try:
            weight_patch.verify(self._aliases, update)
        except ValueError as exc:
            raise EngineError(
                f"full weight update {update.version}: {exc}",
                fix="set sync.options.dtype to the dtype this engine serves "
                f"({weight_patch.dtype_name(self.dtype)})",
            ) from exc


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


def _fail(request: _Request, exc: BaseException) -> None:
    if not request.future.done():
        request.future.set_exception(exc)
