"""The "fsdp2" trainer engine: the controller-side object that drives `world_size` FSDP2 ranks.

The controller holds this object and calls it like any trainer engine; it starts one worker
process per rank (`plait_train.workers.WorkerGroup`), splits each call's data between the
ranks (the datums of a shared prefix stay together, tokens balanced) and merges their results as
one process would have produced them. A rank that dies or hangs fails the call with an
`EngineError` naming it, within `call_timeout_s`, never a silent hang.

State: `save_state` writes a sharded `torch.distributed.checkpoint` (every rank its shards) into
a temporary directory that is renamed into place once every rank has finished; `load_state`
reads it back, also into a different world size. `export_weights` streams the full weights in
buckets: each bucket is gathered on the ranks, shipped to this process, and yielded before the
next is gathered, so no process ever holds all of them at once.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from plait.api import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelError,
    OptimStepResult,
    ResolvedModel,
    TrainerCapabilities,
)
from plait_fsdp2.options import FSDP2Options
from plait_fsdp2.rank import META_FILE, STATE_FORMAT, RankInfo, RankSetup
from plait_train.layout import LayoutOptions, split_for_ranks
from plait_train.perf import FlopsModel
from plait_train.state import check_same_parameters, fsync_tree, replace_dir, temporary_sibling
from plait_train.step import (
    check_data,
    check_loss_config,
    check_token_ids,
    loss_positions,
    to_output,
)
from plait_train.workers import WorkerGroup, tensor_from_wire

log = structlog.get_logger("plait_fsdp2")


class FSDP2Trainer:
    """`plait.protocols.TrainerEngine` on FSDP2 ranks in worker processes."""

    def __init__(
        self, model: ResolvedModel, *, options: FSDP2Options | None = None, seed: int = 0
    ) -> None:
        self.options = options or FSDP2Options()
        self.model_info = model
        # Packed rows need attention that takes arbitrary masks; the ranks check the kernel, and
        # the layout is decided here so that the data split keeps shared prefixes together.
        wanted = self.options.attn_implementation in (None, "sdpa", "eager")
        self.layout = LayoutOptions(
            self.options.micro_batch_tokens,
            packing=self.options.packing and wanted,
            prefix_sharing=self.options.prefix_sharing and wanted,
        )
        start = time.perf_counter()
        self._group = WorkerGroup(
            "plait_fsdp2.rank:FSDP2Rank",
            world_size=self.options.world_size,
            setup=RankSetup(model, self.options, seed, self.layout),
            name="fsdp2 trainer",
            start_timeout_s=self.options.start_timeout_s,
            preload=["plait_fsdp2.rank"],
        )
        info: RankInfo = self._group.infos[0]
        self.vocab_rows = info.vocab_rows
        self.flops: FlopsModel = info.flops
        self._info = info
        self.capabilities = TrainerCapabilities(
            packing=self.layout.packing,
            prefix_sharing=self.layout.prefix_sharing,
            activation_checkpointing=True,
        )
        self._weight_version = 0
        log.info(
            "fsdp2 trainer ready",
            model=model.name,
            world_size=self.options.world_size,
            pids=self._group.pids,
            seconds=round(time.perf_counter() - start, 1),
            packing=self.layout.packing,
            prefix_sharing=self.layout.prefix_sharing,
            activation_checkpointing=self.options.activation_checkpointing,
        )

    # -- protocol ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def peak_flops_per_s(self) -> float:
        """Peak FLOP/s of all ranks together (each rank's device peak, measured or from a
        datasheet)."""
        return self._info.peak_flops_per_s * self.options.world_size

    def flops_per_token(self, seq_len: int) -> float:
        return self.flops.train_flops_per_token(seq_len)

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        return self._data_call("forward", data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        return self._data_call("forward_backward", data, loss_fn, loss_fn_config)

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        metrics = self._call("optim_step", adam_params)[0]
        self._weight_version += 1
        return OptimStepResult(self._weight_version, metrics)

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, CPU tensor) for every parameter (tied ones once), one bucket of
        about `export_bucket_mb` at a time. The tensors are copies, valid as long as they are
        kept."""
        for bucket in self._call("export_plan")[0]:
            names = [name for name, _ in bucket]
            flat = tensor_from_wire(self._call("export_bucket", names)[0])
            offset = 0
            for name, shape in bucket:
                size = int(np.prod(shape))
                yield name, flat[offset : offset + size].view(shape)
                offset += size

    def save_state(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_sibling(path)
        try:
            tmp.mkdir()
            self._call(
                "save_state",
                str(tmp),
                {
                    "weight_version": self._weight_version,
                    "model": self.model_info.name,
                    "saved_at": time.time(),
                },
            )
            fsync_tree(tmp)
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("trainer state saved", path=str(path), weight_version=self._weight_version)

    def load_state(self, path: str | Path) -> None:
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise ModelError(
                f"{path} is not a plait-fsdp2 trainer state (no {META_FILE})",
                fix="pass a directory written by the fsdp2 trainer's save_state",
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != STATE_FORMAT:
            raise ModelError(
                f"trainer state {path} has format {meta.get('format')}, "
                f"this trainer reads {STATE_FORMAT}",
                fix="load it with the plait-fsdp2 version that wrote it",
            )
        check_same_parameters(meta["parameters"], self._info.parameters, path)
        self._call("load_state", str(path))
        self._weight_version = int(meta["weight_version"])
        log.info(
            "trainer state loaded",
            path=str(path),
            weight_version=self._weight_version,
            saved_world_size=meta["world_size"],
            world_size=self.options.world_size,
        )

    def close(self) -> None:
        self._group.close()

    @property
    def pids(self) -> list[int]:
        """The worker processes, by rank."""
        return self._group.pids

    # -- internals --------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> list[Any]:
        return self._group.call(method, *args, timeout_s=self.options.call_timeout_s)

    def _data_call(
        self,
        method: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None,
    ) -> ForwardBackwardOutput:
        # Bad input fails here, before any rank starts a collective it could not finish.
        check_loss_config(loss_fn, check_data(data, loss_fn), loss_fn_config)
        tokens = [np.asarray(d.model_input.to_ints(), dtype=np.int64) for d in data]
        check_token_ids(np.concatenate(tokens), self.vocab_rows, "model_input")
        check_token_ids(
            np.concatenate([d.loss_fn_inputs["target_tokens"].to_numpy() for d in data]),
            self.vocab_rows,
            "loss_fn_inputs['target_tokens']",
        )
        config = dict(loss_fn_config or {})
        shares = split_for_ranks(tokens, self.layout, self.options.world_size)
        # Every rank normalises the entropy bonus by the whole call's positions, not its share's.
        positions = loss_positions(data)
        results = self._group.call_each(
            method,
            [([data[i] for i in share], loss_fn, config, positions) for share in shares],
            timeout_s=self.options.call_timeout_s,
        )
        return to_output(loss_fn, len(data), list(zip(shares, results, strict=True)))
