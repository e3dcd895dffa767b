"""plait-weights' delta format, as types: a `TensorPatch` per changed tensor of a
`WeightUpdate(kind="delta")`, and the `WeightBaseError` of a delta that does not fit the weights
it meets. Torch-free, so that a sync imports them without torch; `plait_weights.patch` diffs,
applies and packs them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from plait.api import WeightSyncError


def _shape(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(n) for n in dims)


@attrs.frozen(eq=False)
class TensorPatch:
    """Changes to some elements of one tensor: the entries of a `WeightUpdate(kind="delta")`.

    Positions are row-major offsets into the flattened tensor, stored gap-encoded: `gaps` is a 1-D
    unsigned integer tensor (uint8, uint16 or int32, the narrowest that fits) whose running sum
    gives the ascending positions (the first gap is the first position). `values` holds, per
    position, either the new value in the receiver's dtype, which *replaces* the old one (an
    overwrite, not an addition, so nothing drifts), or, when `escaped` is set (`bit_steps`), a
    signed integer step (int8, int16 or int32, narrower than the tensor's dtype) of the element's
    raw bit pattern: new bits = old bits + step, exact integer arithmetic, so the result is
    bit-exact too, but only on exactly the base the patch was made against (the update's
    `base_checksum` guards it). A step equal to its dtype's minimum (-128 for int8) is an escape:
    that element's new value is the next one of `escaped` (1-D, in the tensor's dtype), for the
    rare element that moves further than a step holds. `gaps=None` is a dense entry: `values` is
    the whole tensor, flattened. An entry with no gaps and no values changes nothing (it still
    names the tensor for the update's checksum).
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    values: Any
    gaps: Any | None = None
    escaped: Any | None = None

    @property
    def dense(self) -> bool:
        return self.gaps is None

    @property
    def bit_steps(self) -> bool:
        return self.escaped is not None


class WeightBaseError(WeightSyncError, ValueError):
    """A delta weight update does not fit the weights the receiver holds (another version, or other
    bits than the patches were made against); nothing was written. A ValueError too, for callers
    that catch those."""
