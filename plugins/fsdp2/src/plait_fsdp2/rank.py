"""One FSDP2 rank: the model sharded with `fully_shard`, running in a worker process.

Built by `plait_train.workers.WorkerGroup`; `plait_fsdp2.engine.FSDP2Trainer` calls its
methods on every rank at once. Each rank holds 1/world_size of every parameter, gradient and
optimizer moment (dim-0 shards as DTensors); a layer's full parameters exist only while it runs.

Losses are token sums, so gradients are reduced as sums across ranks (divide factor 1): the
ranks' data together give exactly the gradient of one process running all of it.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from plait.api import AdamParams, Datum, ResolvedModel
from plait_fsdp2.options import FSDP2Options
from plait_train import loading
from plait_train.checkpointing import apply_activation_checkpointing, decoder_layers
from plait_train.layout import LayoutOptions
from plait_train.perf import FlopsModel, peak_flops
from plait_train.scorer import TokenScorer
from plait_train.state import rng_state, set_rng_state
from plait_train.step import ShardResult, StepRunner
from plait_train.workers import tensor_to_wire

META_FILE = "plait_fsdp2.json"
STATE_FORMAT = 1
# The scorer wraps the Hugging Face model as `model`; parameter names without it are HF names.
_PREFIX = "model."


@attrs.frozen
class RankSetup:
    model: ResolvedModel
    options: FSDP2Options
    seed: int
    layout: LayoutOptions


@attrs.frozen
class RankInfo:
    vocab_rows: int
    flops: FlopsModel
    peak_flops_per_s: float
    peak_source: str
    parameters: dict[str, list[int]]
    """Full (unsharded) shape of every parameter, by Hugging Face name."""
    chunked_head: bool


def sharded(tensor: torch.Tensor) -> DTensor:
    """`tensor` as the DTensor that fully_shard made it: torch types a module's parameters, and
    their gradients, as plain tensors."""
    assert isinstance(tensor, DTensor), type(tensor)
    return tensor


def use_cuda(options: FSDP2Options) -> bool:
    if options.device == "cpu":
        return False
    available = torch.cuda.is_available() and torch.cuda.device_count() >= options.world_size
    return available if options.device == "auto" else True


class FSDP2Rank:
    def __init__(
        self, rank: int, world_size: int, store: tuple[str, int], setup: RankSetup
    ) -> None:
        options = setup.options
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(options.threads or max(1, (os.cpu_count() or 1) // world_size))
        if use_cuda(options):
            torch.cuda.set_device(rank)
            self.device, backend = torch.device("cuda", rank), "nccl"
        else:
            self.device, backend = torch.device("cpu"), "gloo"
        # Collectives give up a little after the controller would have diagnosed a hang.
        timeout = datetime.timedelta(seconds=options.call_timeout_s + 60)
        tcp = dist.TCPStore(store[0], store[1], None, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("plait-fsdp2", tcp),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        torch.manual_seed(setup.seed)

        compute_dtype, master_dtype = loading.training_dtypes(setup.model, options.mixed_precision)
        model = loading.load_causal_lm(
            setup.model,
            dtype=master_dtype,
            device=self.device,
            attn_implementation=options.attn_implementation,
        )
        if rank == 0:
            loading.check_tokenizer_fits(
                loading.load_tokenizer(setup.model.tokenizer_path), model, setup.model
            )
        model.config.use_cache = False
        self.scorer = TokenScorer(model)  # probes the output head on the full model
        flops = FlopsModel.of(model)
        vocab_rows = loading.embedding_rows(model)
        shapes = {name: list(p.shape) for name, p in model.named_parameters()}
        if options.activation_checkpointing != "none":
            apply_activation_checkpointing(model, options.activation_checkpointing)
        policy = (
            MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            if compute_dtype is not None
            else MixedPrecisionPolicy()
        )
        for layer in decoder_layers(model):
            fully_shard(
                layer, mp_policy=policy, reshard_after_forward=options.reshard_after_forward
            )
        fully_shard(self.scorer, mp_policy=policy)
        for module in self.scorer.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        self.scorer.train()
        self.params = {name.removeprefix(_PREFIX): p for name, p in self.scorer.named_parameters()}
        first = AdamParams()
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()),
            lr=first.learning_rate,
            betas=(first.beta1, first.beta2),
            eps=first.eps,
            weight_decay=first.weight_decay,
        )
        self._init_optimizer_state()
        self.runner = StepRunner(
            self.scorer, layout=setup.layout, device=self.device, flops=flops, vocab_rows=vocab_rows
        )
        peak = peak_flops(self.device.type, compute_dtype or master_dtype)
        self.info = RankInfo(
            vocab_rows, flops, peak.flops_per_s, peak.source, shapes, self.scorer.chunked_head
        )
        self._bucket_bytes = int(options.export_bucket_mb * 2**20)

    # -- calls from the engine ------------------------------------------------------------------

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        call_positions: int,
    ) -> ShardResult:
        with torch.no_grad():
            return self.runner.run(
                data,
                loss_fn,
                loss_fn_config,
                backward=False,
                agree_on_passes=self._most,
                call_positions=call_positions,
            )

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        call_positions: int,
    ) -> ShardResult:
        """`call_positions`: `plait_train.step.loss_positions` of the whole call."""
        return self.runner.run(
            data,
            loss_fn,
            loss_fn_config,
            backward=True,
            agree_on_passes=self._most,
            call_positions=call_positions,
        )

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        grads = [sharded(p.grad) for p in self.params.values() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad in grads:  # every rank holds a disjoint shard: local sums add up to the global one
            squares += grad.to_local().double().square().sum()
        dist.all_reduce(squares)
        grad_norm = math.sqrt(float(squares))
        metrics = {"grad_norm": grad_norm, "lr": float(adam.learning_rate)}
        if not math.isfinite(grad_norm):
            metrics["skipped"] = 1.0  # one bad batch must not poison the weights
        else:
            if adam.grad_clip_norm > 0:
                scale = min(1.0, adam.grad_clip_norm / (grad_norm + 1e-6))
                for grad in grads:
                    grad.to_local().mul_(scale)
            for group in self.optimizer.param_groups:
                group.update(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def export_plan(self) -> list[list[tuple[str, list[int]]]]:
        """Buckets of (name, full shape): parameters of one dtype, about export_bucket_mb each."""
        buckets: list[list[tuple[str, list[int]]]] = []
        size, dtype = 0, None
        for name, param in self.params.items():
            nbytes = param.numel() * param.element_size()
            if (
                not buckets
                or param.dtype != dtype
                or (size + nbytes > self._bucket_bytes and buckets[-1])
            ):
                buckets.append([])
                size, dtype = 0, param.dtype
            buckets[-1].append((name, list(param.shape)))
            size += nbytes
        return buckets

    def export_bucket(self, names: Sequence[str]) -> tuple[str, Any] | None:
        """The full tensors of `names`, gathered on every rank (one collective each), flattened
        into one buffer on rank 0 (None elsewhere)."""
        full = [sharded(self.params[name].detach()).full_tensor() for name in names]
        if self.rank != 0:
            return None
        return tensor_to_wire(torch.cat([t.reshape(-1) for t in full]))

    def save_state(self, path: str, meta: dict[str, Any]) -> None:
        """A torch.distributed.checkpoint of weights, optimizer and pending gradients (each rank
        writes its shards), each rank's RNG state, and (rank 0) the metadata."""
        model_state, optim_state = get_state_dict(self.scorer, self.optimizer)
        grads = {name: p.grad for name, p in self.params.items() if p.grad is not None}
        dcp.save({"model": model_state, "optim": optim_state, "grads": grads}, checkpoint_id=path)
        torch.save(rng_state(), Path(path) / f"rng-rank{self.rank}.pt")
        if self.rank == 0:
            (Path(path) / META_FILE).write_text(
                json.dumps(
                    {
                        **meta,
                        "format": STATE_FORMAT,
                        "world_size": self.world_size,
                        "grads": sorted(grads),
                        "parameters": self.info.parameters,
                    },
                    indent=1,
                )
            )
        dist.barrier()

    def load_state(self, path: str) -> None:
        meta = json.loads((Path(path) / META_FILE).read_text())
        model_state, optim_state = get_state_dict(self.scorer, self.optimizer)
        grads = {name: torch.zeros_like(self.params[name]) for name in meta["grads"]}
        # dcp.load fills the three state dicts in place
        dcp.load({"model": model_state, "optim": optim_state, "grads": grads}, checkpoint_id=path)
        set_state_dict(
            self.scorer, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state
        )
        for name, param in self.params.items():
            param.grad = grads.get(name)
        # RNG streams are per rank; a checkpoint from another world size restores weights and
        # optimizer exactly but starts this rank's RNG where it is.
        rng_file = Path(path) / f"rng-rank{self.rank}.pt"
        if meta["world_size"] == self.world_size and rng_file.exists():
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        dist.barrier()

    def close(self) -> None:
        dist.destroy_process_group()

    # -- internals ------------------------------------------------------------------------------

    def _most(self, passes: int) -> int:
        """The number of micro-batches every rank runs: FSDP's collectives run in lockstep."""
        count = torch.tensor([passes], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    def _init_optimizer_state(self) -> None:
        """AdamW's state exactly as its first step would create it. torch.distributed.checkpoint
        would otherwise initialise an empty state by stepping once with zero gradients, which
        advances Adam's step count and changes the next update."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                self.optimizer.state[param] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
