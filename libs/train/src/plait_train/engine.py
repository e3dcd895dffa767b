"""The half of a single-process trainer engine that does not depend on the model's framework.

`SingleProcessEngine` implements `forward`, `forward_backward`, `optim_step`, `weight_version`
and the FLOP accounting of `plait.protocols.TrainerEngine` on a `StepRunner` (so every such engine
computes logprobs and losses with the same code) and torch's AdamW (`plait_train.optimizer`);
`save_state` / `load_state` write a state directory atomically: the engine's weights (its
`_save_weights` / `_load_weights`), the optimizer state, pending gradients, RNG state and a
metadata file. An engine (plait-torch's, plait-megatron's) builds its model and scorer, calls
`_init_training`, and adds what is its own: weight export and how its weights are stored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog
import torch

from plait.api import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelError,
    OptimStepResult,
    ResolvedModel,
)
from plait_train.optimizer import adamw_step, make_adamw
from plait_train.perf import FlopsModel, PeakFlops, peak_flops
from plait_train.state import (
    check_same_parameters,
    rng_state,
    set_rng_state,
    write_dir_atomically,
)
from plait_train.step import StepRunner, to_output

log = structlog.get_logger("plait_train")

STATE_FORMAT = 1
TRAINING_STATE_FILE = "trainer_state.pt"


class SingleProcessEngine:
    engine_name: str
    """Who wrote a saved state, for error messages ("plait-torch")."""
    state_meta_file: str
    """The metadata file of the engine's saved states (its presence marks a state directory)."""
    output_name = "logprobs"
    """What forward's per-token output is: a policy's logprobs, a value model's "values"."""
    model_info: ResolvedModel
    device: torch.device
    flops: FlopsModel
    optimizer: torch.optim.AdamW
    _runner: StepRunner
    _params: dict[str, torch.nn.Parameter]
    _autocast_dtype: torch.dtype | None
    _weight_version: int

    def _init_training(self, runner: StepRunner, params: Mapping[str, torch.nn.Parameter]) -> None:
        """`params`: every trainable parameter once (tied ones under one name), by the names the
        engine saves them under."""
        self._runner = runner
        self.device, self.flops, self._autocast_dtype = (
            runner.device,
            runner.flops,
            runner.autocast_dtype,
        )
        self._params = dict(params)
        self.optimizer = make_adamw(self._params.values())
        self._weight_version = 0

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def peak_flops(self) -> PeakFlops:
        """Peak matmul FLOP/s of this trainer's device in its compute dtype (measured once per
        process on a CPU, from a datasheet table on known GPUs), with where the number came from."""
        dtype = self._autocast_dtype or next(iter(self._params.values())).dtype
        return peak_flops(self.device.type, dtype)

    @property
    def peak_flops_per_s(self) -> float:
        return self.peak_flops.flops_per_s

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token of a sequence of `seq_len` tokens."""
        return self.flops.train_flops_per_token(seq_len)

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        with torch.no_grad():
            result = self._runner.run(data, loss_fn, loss_fn_config, backward=False)
        return to_output(loss_fn, len(data), [(range(len(data)), result)], self.output_name)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        result = self._runner.run(data, loss_fn, loss_fn_config, backward=True)
        return to_output(loss_fn, len(data), [(range(len(data)), result)], self.output_name)

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        metrics = adamw_step(self.optimizer, list(self._params.values()), adam_params)
        self._weight_version += 1
        return OptimStepResult(self._weight_version, metrics)

    def parameter_shapes(self) -> dict[str, list[int]]:
        return {name: list(param.shape) for name, param in self._params.items()}

    def save_state(self, path: str | Path) -> None:
        """Weights, optimizer state, pending gradients, weight version and RNG state, written to a
        temporary directory, fsynced, then renamed into place."""
        path = Path(path)

        def write(tmp: Path) -> None:
            self._save_weights(tmp)
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "grads": {
                        n: p.grad.detach().cpu()
                        for n, p in self._params.items()
                        if p.grad is not None
                    },
                    "rng": rng_state(),
                },
                tmp / TRAINING_STATE_FILE,
            )
            (tmp / self.state_meta_file).write_text(
                json.dumps(
                    {
                        "format": STATE_FORMAT,
                        "weight_version": self._weight_version,
                        "model": self.model_info.name,
                        "parameters": self.parameter_shapes(),
                        "saved_at": time.time(),
                    },
                    indent=1,
                )
            )

        write_dir_atomically(path, write)
        log.info("trainer state saved", path=str(path), weight_version=self._weight_version)

    def load_state(self, path: str | Path, optimizer: bool = True) -> None:
        """What `save_state` wrote; `optimizer=False`: the weights alone, with fresh AdamW state
        and no pending gradients."""
        path = Path(path)
        meta_path = path / self.state_meta_file
        if not meta_path.is_file():
            raise ModelError(
                f"{path} is not a {self.engine_name} trainer state (no {self.state_meta_file})",
                fix=f"pass a directory written by the {self.engine_name} trainer's save_state",
            )
        meta = json.loads(meta_path.read_text())
        check_same_parameters(meta["parameters"], self.parameter_shapes(), path)
        with torch.no_grad():
            self._load_weights(path)
        # On the CPU: RNG states must stay CPU tensors; the optimizer moves its state to the
        # parameters.
        state = torch.load(path / TRAINING_STATE_FILE, map_location="cpu", weights_only=False)
        if not optimizer:
            self.optimizer = make_adamw(self._params.values())
            state.update(optimizer=self.optimizer.state_dict(), grads={})
        self.optimizer.load_state_dict(state["optimizer"])
        for name, param in self._params.items():
            grad = state["grads"].get(name)
            param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
        set_rng_state(state["rng"])
        self._weight_version = int(meta["weight_version"])
        log.info("trainer state loaded", path=str(path), weight_version=self._weight_version)

    def _save_weights(self, directory: Path) -> None:
        """Write the weights into a state directory."""
        raise NotImplementedError

    def _load_weights(self, directory: Path) -> None:
        """Copy a state directory's weights into the parameters (under no_grad)."""
        raise NotImplementedError

    def _close_training(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._params.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
