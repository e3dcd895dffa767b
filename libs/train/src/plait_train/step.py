"""forward / forward_backward of a trainer engine: data -> micro-batches -> logprobs -> loss.

`StepRunner.run` does one call's work in one process: it lays the data out
(`plait_train.layout`), runs the `TokenScorer` on each micro-batch, applies the plait loss
(a token sum, so micro-batches and processes simply add up) and, for forward_backward, calls
backward. Its `ShardResult` keeps per-chunk metrics unmerged, so that an engine that splits a call
across processes merges them exactly as one process would (`to_output`).

A backward pass needs logprobs only where the loss acts (the `mask` input when given, else
non-zero weights/advantages), so the output head runs only there; a forward pass scores every
position.

The entropy bonus works with every loss: `entropy_coef` in loss_fn_config (taken out before the
loss sees its config) adds -entropy_coef * (sum of the next-token entropy over the positions the
loss acts on) / (their number in the whole call) to the loss, reported as "entropy_bonus:sum".
The KL penalty to a reference policy likewise: `kl_coef` (and `kl_estimator`, "k3" by default)
adds kl_coef * (sum of the estimated KL(pi || ref) over those positions, from the `ref_logprobs`
loss input) / (their number in the whole call), reported as "kl_penalty:sum", and "kl_ref:mean"
whenever the data carry ref_logprobs. A runner given a `reference` scorer supplies ref_logprobs
itself where a call sets kl_coef and its data carry none: the reference policy's logprobs at the
positions the policy is scored at, micro-batch by micro-batch, under torch.no_grad(); a forward
call so supplied also outputs each datum's per-token estimate as "kl_ref" (KL in the reward).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from plait.api import DataError, Datum, ForwardBackwardOutput, TensorData, merge_metrics
from plait_train.layout import (
    INT_INPUTS,
    LayoutOptions,
    MicroBatch,
    RowPlan,
    build_row,
    plan_micro_batches,
)
from plait_train.losses import KL_ESTIMATORS, LossOutput, check_inputs
from plait_train.perf import FlopsModel
from plait_train.routing import RoutingHooks, same_experts
from plait_train.scorer import TokenScorer

ROUTED_EXPERTS = "routed_experts"
"""The loss input that carries the sampler's MoE routing, (positions, layers, top_k) per datum."""
_ROUTING_SUMS = ("routing_agreed:sum", "routing_natural_agreed:sum", "routing_compared:sum")
ENTROPY_COEF = "entropy_coef"
"""The loss_fn_config key of the entropy bonus, which the step runner applies for every loss."""
KL_COEF = "kl_coef"
"""The loss_fn_config key of the KL penalty to a reference policy (every loss)."""
KL_ESTIMATOR = "kl_estimator"
"""The loss_fn_config key of the KL penalty's estimator: "k1", "k2" or "k3" (1, 2, 3 also do)."""
REF_LOGPROBS = "ref_logprobs"
"""The loss input of the KL penalty: the reference policy's logprob of each target token."""
KL_REF = "kl_ref"
"""The output of a forward call that sets kl_coef and whose ref_logprobs the runner supplied: the
per-token estimate of KL(policy || reference), which a batch preparer takes off the rewards."""
# Where a loss acts, by precedence: the `mask` input, else non-zero weights, else advantages.
_ACTIVE_TESTS = (("mask", operator.gt), ("weights", operator.ne), ("advantages", operator.ne))


def lookup_loss(name: str) -> Any:
    from plait.api import get_registry

    return get_registry().get("loss", name).load()


def check_data(data: Sequence[Datum], loss_fn: str) -> list[str]:
    """The loss input keys of `data`, after checking that every datum fits `loss_fn`."""
    if not data:
        raise DataError(
            "no data: forward/forward_backward needs at least one Datum",
            fix="skip the call when a batch is empty",
        )
    keys = sorted(data[0].loss_fn_inputs)
    for index, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise DataError(f"data[{index}] is a {type(datum).__name__}, not a plait.types.Datum")
        if datum.model_input.length == 0:
            raise DataError(
                f"data[{index}] has an empty model_input",
                fix="drop empty sequences before training",
            )
        if sorted(datum.loss_fn_inputs) != keys:
            raise DataError(
                f"data[{index}] has loss_fn_inputs {sorted(datum.loss_fn_inputs)} "
                f"but data[0] has {keys}",
                fix="give every datum of one call the same loss_fn_inputs keys",
            )
    if "target_tokens" not in keys:
        raise DataError(
            f"loss {loss_fn!r} needs loss_fn_inputs['target_tokens']; the data have {keys}",
            fix="add target_tokens (the input shifted by one: targets = seq[1:])",
        )
    try:
        check_inputs(loss_fn, keys)
    except ValueError as exc:
        raise DataError(str(exc), fix="add the missing loss_fn_inputs to every datum") from None
    return keys


@attrs.frozen
class Penalties:
    """What the step runner adds to every loss, from the generic loss_fn_config keys."""

    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"


def _coef(config: dict[str, Any], key: str, example: str, off: str) -> float:
    coef = config.pop(key, 0.0)
    if not isinstance(coef, int | float) or not math.isfinite(coef):
        raise DataError(
            f"loss_fn_config[{key!r}] is {coef!r}, not a finite number",
            fix=f"set {key} to a number (e.g. {example}); leave it out for {off}",
        )
    return float(coef)


def split_loss_config(
    loss_fn_config: Mapping[str, float | str] | None,
) -> tuple[dict[str, float], Penalties]:
    """The loss's own config, and the penalties (entropy bonus, KL penalty; 0: off), which are not
    the loss's to validate."""
    config: dict[str, Any] = dict(loss_fn_config or {})
    entropy_coef = _coef(config, ENTROPY_COEF, "0.001", "no entropy bonus")
    kl_coef = _coef(config, KL_COEF, "0.001", "no KL penalty")
    estimator = config.pop(KL_ESTIMATOR, "k3")
    # A number names an estimator too: some transports carry only numbers in loss_fn_config.
    name = (
        f"k{int(estimator)}"
        if isinstance(estimator, int | float) and estimator in (1, 2, 3)
        else estimator
    )
    if not isinstance(name, str) or name not in KL_ESTIMATORS:
        raise DataError(
            f"loss_fn_config[{KL_ESTIMATOR!r}] is {estimator!r}, "
            f"not one of {sorted(KL_ESTIMATORS)}",
            fix=f"set {KL_ESTIMATOR} to 'k1', 'k2' or 'k3' (or 1, 2, 3); leave it out for k3",
        )
    return config, Penalties(entropy_coef, kl_coef, name)


def check_loss_config(
    loss_fn: str,
    keys: Sequence[str],
    loss_fn_config: Mapping[str, float | str] | None,
    *,
    reference: bool = False,
) -> Any:
    """The loss function, after a trial run on one zero token: an unknown loss name or a config
    the loss rejects fails before any forward pass (which, split across processes, could not be
    abandoned halfway). `reference`: the engine supplies ref_logprobs where the data lack them."""
    loss = lookup_loss(loss_fn)
    config, penalties = split_loss_config(loss_fn_config)
    if penalties.kl_coef and REF_LOGPROBS not in keys and reference:
        keys = [*keys, REF_LOGPROBS]
    if penalties.kl_coef and REF_LOGPROBS not in keys:
        raise DataError(
            f"loss_fn_config[{KL_COEF!r}] is set, but the data carry no "
            f"loss_fn_inputs[{REF_LOGPROBS!r}]; they have {sorted(keys)}",
            fix=f"give every datum {REF_LOGPROBS}: the reference policy's logprob of each target "
            f"token (0 where the loss does not act), or let the trainer compute them "
            f"(trainer.options.reference = true, plait-torch), or leave {KL_COEF} out",
        )
    zero = torch.zeros(1)
    trial = {k: zero.long() if k in INT_INPUTS else zero for k in keys}
    try:
        loss(zero, trial, config)
    except (ValueError, KeyError) as exc:
        raise DataError(
            f"loss {loss_fn!r} rejected its inputs: {exc}",
            fix="give every datum the loss_fn_inputs and loss_fn_config the loss documents",
        ) from exc
    return loss


def check_token_ids(ids: Any, vocab_rows: int, what: str) -> None:
    """Fail on token ids outside [0, vocab_rows); `ids` is a numpy array or a torch tensor."""
    if (ids.numel() if hasattr(ids, "numel") else ids.size) == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_rows:
        bad = low if low < 0 else high
        raise DataError(
            f"{what} contains token id {bad}, outside the model's vocabulary [0, {vocab_rows})",
            fix="tokenize with the model's own tokenizer (model.tokenizer must match the model)",
        )


def _active(inputs: Mapping[str, Any]) -> Any:
    """Where the loss acts in `inputs` (numpy arrays or tensors); None: at every position."""
    for key, test in _ACTIVE_TESTS:
        if key in inputs:
            return test(inputs[key], 0)
    return None


def active_positions(batch: MicroBatch) -> torch.Tensor:
    """Positions the loss acts on: the `mask` input if given, else non-zero weights/advantages."""
    active = _active(batch.inputs)
    return batch.valid if active is None else active & batch.valid


def loss_positions(data: Sequence[Datum]) -> int:
    """How many positions the loss acts on in `data` (as `active_positions`): the entropy bonus of
    a call is normalised by this count of the whole call, also where processes share the call."""
    total = 0
    for datum in data:
        inputs = datum.loss_fn_inputs
        active = _active({k: inputs[k].to_numpy() for k, _ in _ACTIVE_TESTS if k in inputs})
        total += datum.model_input.length if active is None else int(active.sum())
    return total


def scored_positions(batch: MicroBatch, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the datum positions a pass scores: where the loss acts for a backward
    pass, every real position for a forward pass."""
    rows, cols = (active_positions(batch) if backward else batch.valid).nonzero(as_tuple=True)
    return rows, cols


def _score(
    scorer: Any, batch: MicroBatch, rows: torch.Tensor, cols: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scorer`'s (logprob, entropy) of each target token of `batch` at positions (rows, cols)."""
    return scorer(
        batch.input_ids,
        batch.position_ids,
        batch.reach,
        batch.slots[rows, cols],
        batch.inputs["target_tokens"][rows, cols],
    )


def _in_group_order(
    rows: Sequence[RowPlan], tokens: Sequence[np.ndarray], groups: Sequence[int]
) -> list[RowPlan]:
    """A micro-batch's rows, and each row's datums, in the order of their groups: where the
    packing allows, each group's tokens are then one stretch of the micro-batch, which its adapter
    takes as it is, with no gather into adapter order (`plait_train.lora.LoraBank.routing`)."""
    ordered = [
        row
        if len({groups[i] for i in row.members}) == 1
        else build_row(tokens, sorted(row.members, key=groups.__getitem__), share=False)
        for row in rows
    ]
    return sorted(ordered, key=lambda row: (groups[row.members[0]], groups[row.members[-1]]))


class AdapterRouter(Protocol):
    """What `StepRunner.run_groups` needs of a LoRA bank: tokens routed to adapters by name."""

    def routing(
        self, adapter_of_token: torch.Tensor, names: Sequence[str]
    ) -> contextlib.AbstractContextManager[None]: ...


class _Outcome(dict[int, tuple[dict[str, float], float, int]]):
    """A micro-batch's logprobs (rows x positions) and, per group: its loss metrics (the entropy
    bonus included), the entropy summed over its loss-active positions, and their number."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        super().__init__()
        self.logprobs = logprobs


@attrs.frozen
class ShardResult:
    """What one process computed for its data (indices are positions in the data it was given)."""

    logprobs: dict[int, np.ndarray]
    parts: list[tuple[dict[str, float], int]]
    """Per micro-batch: loss metrics and the number of loss-active tokens (the weight of means)."""
    totals: dict[str, float]
    """Sums over the data: model_flops, train_tokens, forward_tokens, prefix_shared_tokens."""
    kl_ref: dict[int, np.ndarray] = attrs.field(factory=dict)
    """A forward pass that supplied ref_logprobs: each datum's per-token estimate of the KL to the
    reference (the call's kl_estimator) at every position, for KL in the reward."""


def to_output(
    loss_fn: str,
    count: int,
    shards: Sequence[tuple[Sequence[int], ShardResult]],
    output_name: str = "logprobs",
) -> ForwardBackwardOutput:
    """One call's output from the results of every process: (indices into the call's data of the
    shard's data, its result); each datum's per-token output under `output_name` (a value
    model's are "values")."""
    outputs: list[dict[str, TensorData]] = [{} for _ in range(count)]
    parts: list[tuple[dict[str, float], int]] = []
    totals: dict[str, float] = {}
    for indices, result in shards:
        for local, logprobs in result.logprobs.items():
            outputs[indices[local]] = {output_name: TensorData.from_numpy(logprobs)}
        for local, kl in result.kl_ref.items():
            outputs[indices[local]][KL_REF] = TensorData.from_numpy(kl)
        parts.extend(result.parts)
        for key, value in result.totals.items():
            totals[key] = totals.get(key, 0.0) + value
    metrics = merge_metrics(parts)
    metrics.update(totals)
    if totals.get("routing_compared:sum"):
        metrics["routing_agreement:mean"] = (
            totals["routing_agreed:sum"] / totals["routing_compared:sum"]
        )
        metrics["routing_natural_agreement:mean"] = (
            totals["routing_natural_agreed:sum"] / totals["routing_compared:sum"]
        )
        metrics["routing_bytes_per_token:mean"] = (
            totals["routing_bytes:sum"] / totals["routing_positions:sum"]
        )
    return ForwardBackwardOutput(
        loss_fn_output_type=loss_fn, loss_fn_outputs=outputs, metrics=metrics
    )


class StepRunner:
    """Runs forward / forward_backward of one process's data through a `TokenScorer`."""

    def __init__(
        self,
        scorer: TokenScorer | torch.nn.Module,
        *,
        layout: LayoutOptions,
        device: torch.device,
        flops: FlopsModel,
        vocab_rows: int,
        autocast_dtype: torch.dtype | None = None,
        routing: RoutingHooks | None = None,
        routing_replay: bool = False,
        reference: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """`routing`: the model's router hooks (MoE models), which compare the trainer's routing
        with the sampler's routed_experts and, with `routing_replay`, force the sampler's.
        `reference`: the reference policy as a scorer (`TokenScorer`'s signature), which supplies
        ref_logprobs to calls that set kl_coef without them (see the module doc)."""
        if routing_replay and routing is None:
            raise ValueError(
                "routing replay needs the model's router hooks (a mixture-of-experts model)"
            )
        self.routing = routing
        self.routing_replay = routing_replay
        self.scorer = scorer
        self.layout = layout
        self.device = device
        self.flops = flops
        self.vocab_rows = vocab_rows
        self.autocast_dtype = autocast_dtype
        self.reference = reference

    def run(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        *,
        backward: bool,
        agree_on_passes: Callable[[int], int] | None = None,
        call_positions: int | None = None,
    ) -> ShardResult:
        """`agree_on_passes(n)`: for processes that must run forward passes in lockstep (FSDP):
        given this process's number of micro-batches, the number every process runs; the missing
        ones are run on a one-token dummy whose loss is zero. `call_positions`: where `data` is a
        share of a call, `loss_positions` of the whole call (which normalises the entropy bonus);
        by default those of `data`."""
        return self.run_groups(
            data,
            [0] * len(data),
            loss_fn,
            loss_fn_config,
            backward=backward,
            agree_on_passes=agree_on_passes,
            call_positions=None if call_positions is None else [call_positions],
        )[0]

    def run_groups(
        self,
        data: Sequence[Datum],
        groups: Sequence[int],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        *,
        backward: bool,
        router: AdapterRouter | None = None,
        adapters: Sequence[str] = (),
        agree_on_passes: Callable[[int], int] | None = None,
        call_positions: Sequence[int] | None = None,
    ) -> list[ShardResult]:
        """Several callers' data in the same passes: datum i belongs to group `groups[i]` (0..G-1),
        and each group gets the result it would get alone (its logprobs, its loss metrics, its
        token counts), its loss reduced over its own tokens. With `router`, each group's tokens go
        through adapter `adapters[group]` (`plait_train.lora.LoraBank.routing`); the groups then
        share rows (packing) but no prefixes, and the routing stays set through the backward pass
        (activation checkpointing recomputes the forward there). `call_positions`: per group, as
        in `run`."""
        config, penalties = split_loss_config(loss_fn_config)
        count = max(groups, default=-1) + 1
        if call_positions is None:
            call_positions = [
                loss_positions([d for d, g in zip(data, groups, strict=True) if g == group])
                for group in range(count)
            ]
        # The entropy bonus per unit of entropy, per group: the call's mean, not a micro-batch's;
        # the KL penalty per unit of KL likewise.
        entropy_coef, kl_coef = penalties.entropy_coef, penalties.kl_coef
        entropy_scales = [-entropy_coef / n if entropy_coef and n else 0.0 for n in call_positions]
        kl_scales = [kl_coef / n if kl_coef and n else 0.0 for n in call_positions]
        # A process of a lockstep group may get no data at all; it still runs its share of passes.
        keys = check_data(data, loss_fn) if data or agree_on_passes is None else []
        routing = self._routing(data, keys)
        keys = [k for k in keys if k != ROUTED_EXPERTS]
        supply = bool(penalties.kl_coef and keys and REF_LOGPROBS not in keys)
        supply = supply and self.reference is not None
        loss = (
            check_loss_config(loss_fn, keys, loss_fn_config, reference=self.reference is not None)
            if keys
            else lookup_loss(loss_fn)
        )
        tokens = [np.asarray(d.model_input.to_ints(), dtype=np.int64) for d in data]
        inputs = [{k: d.loss_fn_inputs[k].to_numpy() for k in keys} for d in data]
        if data:
            check_token_ids(np.concatenate(tokens), self.vocab_rows, "model_input")
            check_token_ids(
                np.concatenate([i["target_tokens"] for i in inputs]),
                self.vocab_rows,
                "loss_fn_inputs['target_tokens']",
            )
        layout = (
            attrs.evolve(self.layout, prefix_sharing=False) if router is not None else self.layout
        )
        plans = plan_micro_batches(tokens, layout) if data else []
        if router is not None:
            plans = [_in_group_order(rows, tokens, groups) for rows in plans]
        passes = agree_on_passes(len(plans)) if agree_on_passes is not None else len(plans)
        results = [
            ShardResult(
                {},
                [],
                {
                    "model_flops:sum": 0.0,
                    "forward_tokens:sum": 0.0,
                    "prefix_shared_tokens:sum": 0.0,
                },
            )
            for _ in range(max(count, 1))
        ]
        per_token = (
            self.flops.train_flops_per_token if backward else self.flops.forward_flops_per_token
        )
        if routing is not None:
            totals = results[0].totals
            totals.update({key: 0.0 for key in _ROUTING_SUMS})
            totals["routing_bytes:sum"] = float(
                sum(d.loss_fn_inputs[ROUTED_EXPERTS].data.nbytes for d in data)
            )
            totals["routing_positions:sum"] = float(sum(len(t) for t in tokens))
        for rows in plans:
            batch = MicroBatch.build(rows, tokens, inputs, self.device, routing)
            member_groups = [groups[index] for index in batch.indices]
            if supply:
                batch.inputs[REF_LOGPROBS] = self._reference_logprobs(batch, backward)
            with self._adapters(batch, member_groups, router, adapters):
                outcome = self._micro_batch(
                    batch,
                    member_groups,
                    loss,
                    loss_fn,
                    config,
                    entropy_scales,
                    (kl_scales, penalties.kl_estimator),
                    backward,
                )
            if batch.routing is not None:
                for key, value in self._routing_agreement(batch).items():
                    results[0].totals[key] += value
            for group, (chunk_metrics, entropy_sum, active) in outcome.items():
                if active:
                    chunk_metrics["entropy:mean"] = entropy_sum / active
                results[group].parts.append((chunk_metrics, active))
                group_tokens = sum(
                    batch.lengths[row] for row, g in enumerate(member_groups) if g == group
                )
                results[group].totals["forward_tokens:sum"] += (
                    batch.computed_tokens * group_tokens / sum(batch.lengths)
                )
            kl = (
                KL_ESTIMATORS[penalties.kl_estimator](outcome.logprobs, batch.inputs[REF_LOGPROBS])
                if supply and not backward
                else None
            )
            for row, index in enumerate(batch.indices):
                result = results[member_groups[row]]
                result.logprobs[index] = outcome.logprobs[row, : batch.lengths[row]].cpu().numpy()
                if kl is not None:
                    result.kl_ref[index] = kl[row, : batch.lengths[row]].float().cpu().numpy()
                result.totals["model_flops:sum"] += per_token(batch.lengths[row]) * batch.owned[row]
                result.totals["prefix_shared_tokens:sum"] += batch.lengths[row] - batch.owned[row]
        for _ in range(passes - len(plans)):
            self._dummy_pass(backward)
        if backward:
            for group, result in enumerate(results):
                result.totals["train_tokens:sum"] = float(
                    sum(len(t) for t, g in zip(tokens, groups, strict=True) if g == group)
                )
        return results

    def _adapters(
        self,
        batch: MicroBatch,
        member_groups: Sequence[int],
        router: AdapterRouter | None,
        adapters: Sequence[str],
    ) -> Any:
        """The routing of every slot of `batch` to its group's adapter (-1: padding, the base)."""
        if router is None:
            return contextlib.nullcontext()
        adapter_of = torch.full(
            (batch.input_ids.numel(),), -1, dtype=torch.long, device=batch.input_ids.device
        )
        for row, group in enumerate(member_groups):
            adapter_of[batch.slots[row, : batch.lengths[row]]] = group
        # A padding slot goes through the adapter of the slot before it (every row starts with
        # a datum's): its output reaches no loss and no other slot, and so every group's
        # tokens are one stretch of the micro-batch wherever `_in_group_order` could make them.
        slots = torch.arange(len(adapter_of), device=adapter_of.device)
        adapter_of = adapter_of[torch.where(adapter_of >= 0, slots, 0).cummax(0).values]
        return router.routing(adapter_of.view_as(batch.input_ids), adapters)

    def _routing(self, data: Sequence[Datum], keys: Sequence[str]) -> list[np.ndarray] | None:
        """The data's routed experts, when the model routes (and routing data came with them)."""
        if self.routing_replay and ROUTED_EXPERTS not in keys and data:
            raise DataError(
                "trainer.options.routing_replay is on, but the data carry no routed_experts",
                fix="ask the sampler for them "
                "(inference.options.enable_return_routed_experts = true)",
            )
        if self.routing is None or ROUTED_EXPERTS not in keys:
            return None
        return [d.loss_fn_inputs[ROUTED_EXPERTS].to_numpy() for d in data]

    def _routing_agreement(self, batch: MicroBatch) -> dict[str, float]:
        """Token-layers whose experts (as used, and as the trainer's router chose them) are the
        sampler's, over the slots the routing data covers."""
        assert self.routing is not None and batch.routing is not None and batch.routed is not None
        recorded = batch.routing[batch.routed]
        used = self.routing.stacked(self.routing.used)[batch.routed]
        chosen = self.routing.stacked(self.routing.chosen)[batch.routed]
        return {
            "routing_agreed:sum": float(same_experts(used, recorded).sum()),
            "routing_natural_agreed:sum": float(same_experts(chosen, recorded).sum()),
            "routing_compared:sum": float(recorded.shape[0] * recorded.shape[1]),
        }

    def _reference_logprobs(self, batch: MicroBatch, backward: bool) -> torch.Tensor:
        """(B, L) the reference policy's logprob of each target token of `batch` where the pass
        scores the policy (`scored_positions`), 0 elsewhere; no grad."""
        assert self.reference is not None
        rows, cols = scored_positions(batch, backward)
        with torch.no_grad(), self._autocast():
            flat, _ = _score(self.reference, batch, rows, cols)
        zeros = torch.zeros(batch.valid.shape, dtype=torch.float32, device=flat.device)
        return zeros.index_put((rows, cols), flat.float())

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _micro_batch(
        self,
        batch: MicroBatch,
        member_groups: Sequence[int],
        loss: Any,
        loss_name: str,
        config: dict[str, float],
        entropy_scales: Sequence[float],
        kl: tuple[Sequence[float], str],
        backward: bool,
    ) -> _Outcome:
        """`kl`: the KL penalty's scale per group, and its estimator."""
        kl_scales, kl_estimator = kl[0], KL_ESTIMATORS[kl[1]]
        ref = batch.inputs.get(REF_LOGPROBS)
        active = active_positions(batch)
        rows, cols = scored_positions(batch, backward)
        replay = (
            self.routing.forced(batch.routing)
            if self.routing_replay and self.routing is not None and batch.routing is not None
            else contextlib.nullcontext()
        )
        with self._autocast(), replay:
            flat, entropy = _score(self.scorer, batch, rows, cols)
        logprobs = flat.new_zeros(batch.valid.shape).index_put((rows, cols), flat)
        group_of_row = torch.tensor(member_groups, device=logprobs.device)
        outcome = _Outcome(logprobs.detach())
        total: torch.Tensor | None = None
        for group in sorted(set(member_groups)):
            mine = group_of_row == group
            inputs = {key: value[mine] for key, value in batch.inputs.items()}
            try:
                out: LossOutput = loss(logprobs[mine], inputs, config)
            except (ValueError, KeyError) as exc:
                raise DataError(
                    f"loss {loss_name!r} rejected its inputs: {exc}",
                    fix="give every datum the loss_fn_inputs and loss_fn_config the loss documents",
                ) from exc
            counted = active[rows, cols] & mine[rows]
            entropy_sum = entropy[counted].sum()
            metrics, group_loss = dict(out.metrics), out.loss
            if entropy_scales[group]:
                bonus = entropy_scales[group] * entropy_sum
                metrics["entropy_bonus:sum"] = float(bonus.detach())
                group_loss = group_loss + bonus
            if ref is not None:
                # The estimate over the loss's positions; differentiable only when penalised.
                lp = flat[counted] if kl_scales[group] else flat[counted].detach()
                kl_sum = kl_estimator(lp.float(), ref[rows, cols][counted].float()).sum()
                if counted.any():
                    metrics["kl_ref:mean"] = float(kl_sum.detach()) / int(counted.sum())
                if kl_scales[group]:
                    penalty = kl_scales[group] * kl_sum
                    metrics["kl_penalty:sum"] = float(penalty.detach())
                    group_loss = group_loss + penalty
            outcome[group] = (metrics, float(entropy_sum.detach()), int(active[mine].sum()))
            total = group_loss if total is None else total + group_loss
        if backward and total is not None:
            total.backward()
        return outcome

    def _dummy_pass(self, backward: bool) -> None:
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with self._autocast():
            logprob, _ = self.scorer(one, None, None, one[0], one[0])
        if backward:
            (logprob.sum() * 0.0).backward()
