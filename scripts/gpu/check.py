"""The parts of the GPU check, run by scripts/gpu/check.sh (read its header for how to run it).

Each part is timed and recorded in one JSON file, `gpu_check.json` in the output directory,
rewritten after every part so that a run stopped at its time limit still leaves what it finished:

- peak: the device's bf16 matmul FLOP/s, measured (plait_train.perf.measure_matmul_flops), and the
  datasheet figure plait-torch's trainer reports MFU against;
- model: a random Qwen3 with Qwen3-0.6B's shapes and the real Qwen3 tokenizer
  (plait_torch.models.build_random_qwen3); tiny-qwen3-8k's shapes with --dry-run;
- trainer: plait-torch's trainer engine in bf16 (float32 master weights, bf16 autocast) on an SFT
  batch and a GRPO-shaped batch (groups sharing a prompt): forward_backward + optim_step, tokens/s
  and MFU against the measured peak (plait's FLOP accounting: model_flops of each call);
- sampling: plait-torch's inference engine in bf16, groups of samples of a fixed length: tokens/s,
  and the sampled tokens' logprobs against one forward pass over the whole sequence (the KV cache
  at work);
- fsdp2: plait-fsdp2's trainer on one rank (NCCL on CUDA, gloo on the CPU) on the same SFT batch;
  its first loss must match plait-torch's (same weights, same data);
- grpo: the test-sized example (examples/arith_tiny.toml) for a few steps through `plait run`;
- pytest_gpu: the tests marked `gpu` (`pytest -m gpu` over the test files that use the marker).

A part that fails is recorded with its error and the next part runs; the exit status is 1 when
any part failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
RESULT_FILE = "gpu_check.json"
TEST_DIRS = ("core", "libs", "sdk", "plugins", "envs", "renderers", "examples", "tests")
# Token ids drawn for prompts and training data: regular tokens of the Qwen3 tokenizer (151643 of
# them, then its special tokens; the embedding has 151936 rows).
TOKEN_IDS = 150_000

DRY_RUN_NOTE = (
    "a dry run: tiny sizes on the CPU, which test the plumbing, not the speed (CPU bf16 matmuls "
    "are slow, and plait's output head runs in float32, so 'mfu' against the bf16 peak can pass 1)"
)
# Mean |sampled logprob - forward logprob| above which the sampler's KV cache counts as broken.
SAMPLED_LOGPROB_TOLERANCE = 0.05

QWEN3_06B_SHAPES: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one check: `gpu_plan` for the lent H100 (see check.sh), `dry_run_plan` for
    the CPU."""

    device: Literal["cpu", "cuda"]
    model_label: str
    model_shapes: dict[str, Any]
    matmul_size: int
    matmul_seconds: float
    micro_batch_tokens: int
    sft_rows: int
    sft_len: int
    rl_groups: int
    rl_group_size: int
    rl_prompt_len: int
    rl_completion_len: int
    timed_steps: int
    sample_prompts: int
    sample_n: int
    sample_prompt_len: int
    sample_shared_len: int
    sample_new_tokens: int
    sample_repeats: int
    grpo_model: str
    grpo_overrides: tuple[str, ...]
    budget_s: float
    """Seconds the parts may take together; a subprocess part gets at most what is left."""
    tokenizer_tokens: int | None = None
    """The Qwen3 tokenizer cut to this many tokens (the model's vocabulary); None: all of it."""
    token_ids: int = TOKEN_IDS
    """Prompts and training data draw token ids below this."""


def gpu_plan() -> Plan:
    return Plan(
        device="cuda",
        model_label="qwen3-0.6b-shaped (random)",
        model_shapes=QWEN3_06B_SHAPES,
        matmul_size=8192,
        matmul_seconds=2.0,
        micro_batch_tokens=8192,
        sft_rows=16,
        sft_len=1024,
        rl_groups=8,
        rl_group_size=8,
        rl_prompt_len=256,
        rl_completion_len=384,
        timed_steps=3,
        sample_prompts=16,
        sample_n=8,
        sample_prompt_len=256,
        sample_shared_len=64,
        sample_new_tokens=256,
        sample_repeats=2,
        grpo_model="tiny-qwen3-arith",
        grpo_overrides=("rl.steps=10", "eval.every=5"),
        # With the install (under a minute) and a minute at least for the gpu tests, the command
        # ends within 9 minutes even when a part runs long; estimated, the parts take about 5.
        budget_s=450.0,
    )


def dry_run_plan() -> Plan:
    from plait_torch.models import TINY_QWEN3_8K_CONFIG

    return Plan(
        device="cpu",
        model_label="tiny-qwen3-8k-shaped (random)",
        model_shapes=dict(TINY_QWEN3_8K_CONFIG),
        tokenizer_tokens=TINY_QWEN3_8K_CONFIG["vocab_size"],
        token_ids=8000,  # below the cut tokenizer's 8,166 regular tokens
        matmul_size=256,
        matmul_seconds=0.2,
        micro_batch_tokens=256,
        sft_rows=4,
        sft_len=64,
        rl_groups=2,
        rl_group_size=4,
        rl_prompt_len=32,
        rl_completion_len=16,
        timed_steps=1,
        sample_prompts=2,
        sample_n=2,
        sample_prompt_len=24,
        sample_shared_len=16,
        sample_new_tokens=8,
        sample_repeats=1,
        # tiny-qwen3-arith is taught by 480 supervised steps when first built (about a minute on
        # 2 cores); its random base runs the same code paths in seconds.
        grpo_model="tiny-qwen3-8k",
        grpo_overrides=(
            "rl.steps=2",
            "rl.groups_per_batch=4",
            "rl.group_size=4",
            "eval.every=2",
            "eval.tasks=8",
        ),
        budget_s=1800.0,
    )


class Check:
    def __init__(self, plan: Plan, out: Path, work: Path, dry_run: bool, setup_s: float) -> None:
        self.plan, self.out, self.work = plan, out, work
        self.start = time.perf_counter()
        self.model_dir = work / "model"
        self.sft_first_loss: float | None = None
        self.peaks: list[float] = []
        self.result: dict[str, Any] = {
            "check": "gpu_check",
            "dry_run": dry_run,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "note": DRY_RUN_NOTE if dry_run else None,
            "plan": dataclasses.asdict(plan),
            "environment": environment(plan.device),
            "setup_seconds": setup_s,
            "parts": {},
        }

    # -- bookkeeping ------------------------------------------------------------------------

    def log(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{time.strftime('%H:%M:%S')} +{elapsed:6.1f}s] {message}", flush=True)

    def remaining_s(self) -> float:
        return self.plan.budget_s - (time.perf_counter() - self.start)

    def run_part(self, name: str, part: Callable[[], dict[str, Any]]) -> None:
        self.log(f"{name}: start")
        started = time.perf_counter()
        try:
            result = part()
        except Exception as exc:
            result = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-6000:],
            }
            print(result["traceback"], file=sys.stderr, flush=True)
        result.setdefault("ok", True)
        result["seconds"] = round(time.perf_counter() - started, 2)
        self.result["parts"][name] = result
        self.write()
        status = "ok" if result["ok"] else f"FAILED ({result.get('error', 'see above')})"
        self.log(f"{name}: {status} in {result['seconds']:.1f} s")

    def write(self) -> None:
        parts = self.result["parts"]
        self.result["ok"] = bool(parts) and all(part["ok"] for part in parts.values())
        self.result["wall_seconds"] = round(time.perf_counter() - self.start, 2)
        self.result["summary"] = summary(parts)
        path = self.out / RESULT_FILE
        path.write_text(json.dumps(self.result, indent=1, default=str) + "\n")

    def synchronize(self) -> None:
        if self.plan.device == "cuda":
            torch.cuda.synchronize()

    def resolved_model(self) -> Any:
        from plait.models import ResolvedModel

        if not (self.model_dir / "config.json").is_file():
            raise RuntimeError("the model part did not build the model")
        return ResolvedModel(self.plan.model_label, self.model_dir, self.model_dir, "bfloat16")

    def cuda_memory(self) -> dict[str, float]:
        if self.plan.device != "cuda":
            return {}
        gib = 2.0**30
        return {
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2),
        }

    def release_cuda(self) -> None:
        gc.collect()
        if self.plan.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    # -- parts ------------------------------------------------------------------------------

    def peak(self) -> dict[str, Any]:
        from plait_train.perf import measure_matmul_flops, peak_flops

        device = torch.device(self.plan.device)
        measured = measure_matmul_flops(
            device, torch.bfloat16, size=self.plan.matmul_size, seconds=self.plan.matmul_seconds
        )
        self.peaks.append(measured)
        result: dict[str, Any] = {
            "matmul_size": self.plan.matmul_size,
            "dtype": "bfloat16",
            "measured_tflops": tflops(measured),
        }
        if self.plan.device == "cuda":  # on a CPU plait measures its own (seconds of bf16 matmuls)
            reference = peak_flops(self.plan.device, torch.bfloat16)
            result.update(
                plait_peak_tflops=tflops(reference.flops_per_s),
                plait_peak_source=reference.source,
            )
        return result

    def build_model(self) -> dict[str, Any]:
        from plait_torch.models import build_random_qwen3, qwen3_tokenizer_dir

        build_random_qwen3(
            self.model_dir, "Qwen3", self.plan.model_shapes, self.plan.tokenizer_tokens
        )
        weights = sum(f.stat().st_size for f in self.model_dir.glob("*.safetensors"))
        return {
            "architecture": "Qwen3ForCausalLM",
            "shapes": self.plan.model_shapes,
            "tokenizer": str(qwen3_tokenizer_dir()),
            "tokenizer_tokens": self.plan.tokenizer_tokens or "all",
            "safetensors_gib": round(weights / 2.0**30, 3),
        }

    def trainer(self) -> dict[str, Any]:
        from plait.types import AdamParams
        from plait_torch.options import TorchTrainerOptions
        from plait_torch.trainer import TorchTrainer

        self.release_cuda()
        options = TorchTrainerOptions(
            device=self.plan.device, micro_batch_tokens=self.plan.micro_batch_tokens
        )
        loaded = time.perf_counter()
        trainer = TorchTrainer(self.resolved_model(), options=options, seed=0)
        load_s = time.perf_counter() - loaded
        adam = AdamParams(learning_rate=1e-5)
        workloads: dict[str, Any] = {}
        try:
            for name, (data, loss) in self.workloads().items():
                first, timings = self.train_steps(
                    trainer.forward_backward, trainer.optim_step, data, loss, adam
                )
                if name == "sft":
                    self.sft_first_loss = first
                workloads[name] = self.throughput(timings, first, data)
            # The peak again, after the GPU has been busy a while (clocks up): the higher counts.
            self.peaks.append(self.measure_peak_again())
            # On a GPU, also against the datasheet peak that plait's own perf/mfu metric uses.
            datasheet = trainer.peak_flops if self.plan.device == "cuda" else None
            for workload in workloads.values():
                achieved = workload.pop("model_flops_per_s")
                workload["mfu"] = round(achieved / max(self.peaks), 4)
                if datasheet is not None:
                    workload["mfu_vs_plait_peak"] = round(achieved / datasheet.flops_per_s, 4)
            return {
                "engine": "plait-torch",
                "device": str(trainer.device),
                "options": {
                    "micro_batch_tokens": options.micro_batch_tokens,
                    "mixed_precision": options.mixed_precision,
                    "packing": options.packing,
                    "prefix_sharing": options.prefix_sharing,
                },
                "load_seconds": round(load_s, 2),
                "measured_peak_tflops": tflops(max(self.peaks)),
                "plait_peak_source": datasheet.source if datasheet else None,
                "workloads": workloads,
                "mfu": max(w["mfu"] for w in workloads.values()),
                **self.cuda_memory(),
                "ok": all(bool(np.isfinite(w["losses"]).all()) for w in workloads.values()),
            }
        finally:
            trainer.close()
            del trainer
            self.release_cuda()

    def measure_peak_again(self) -> float:
        from plait_train.perf import measure_matmul_flops

        device = torch.device(self.plan.device)
        return measure_matmul_flops(
            device, torch.bfloat16, size=self.plan.matmul_size, seconds=self.plan.matmul_seconds
        )

    def workloads(self) -> dict[str, tuple[list[Any], str]]:
        """(data, loss) of each trainer workload: the same data every time it is asked for."""
        plan = self.plan
        rng = np.random.default_rng(1)
        return {
            "sft": (sft_batch(rng, plan.sft_rows, plan.sft_len, plan.token_ids), "cross_entropy"),
            "grpo": (
                rl_batch(
                    rng,
                    plan.rl_groups,
                    plan.rl_group_size,
                    plan.rl_prompt_len,
                    plan.rl_completion_len,
                    plan.token_ids,
                ),
                "importance_sampling",
            ),
        }

    def train_steps(
        self,
        forward_backward: Callable[..., Any],
        optim_step: Callable[..., Any],
        data: list[Any],
        loss: str,
        adam: Any,
    ) -> tuple[float, list[tuple[float, dict[str, float]]]]:
        """The first (warm-up) step's loss, and (seconds, metrics) of each timed step."""
        first = forward_backward(data, loss).metrics["loss:sum"]
        optim_step(adam)
        timings = []
        for _ in range(self.plan.timed_steps):
            self.synchronize()
            started = time.perf_counter()
            metrics = forward_backward(data, loss).metrics
            optim_step(adam)
            self.synchronize()
            timings.append((time.perf_counter() - started, metrics))
        return float(first), timings

    def throughput(
        self, timings: list[tuple[float, dict[str, float]]], first: float, data: list[Any]
    ) -> dict[str, Any]:
        seconds = [s for s, _ in timings]
        step_s = statistics.median(seconds)
        metrics = timings[-1][1]
        tokens = metrics["train_tokens:sum"]
        flops = metrics["model_flops:sum"]
        return {
            "datums": len(data),
            "tokens_per_datum": data[0].model_input.length + 1,
            "step_seconds": [round(s, 4) for s in seconds],
            "step_seconds_median": round(step_s, 4),
            "train_tokens_per_step": tokens,
            "tokens_per_s": round(tokens / step_s, 1),
            "model_tflops_per_step": tflops(flops),
            "model_flops_per_s": flops / step_s,
            "losses": [first, *(m["loss:sum"] for _, m in timings)],
        }

    def sampling(self) -> dict[str, Any]:
        from plait.types import SamplingParams
        from plait_torch.inference import TorchInferenceEngine
        from plait_torch.options import TorchInferenceOptions

        plan = self.plan
        self.release_cuda()
        rows = plan.sample_prompts * plan.sample_n
        options = TorchInferenceOptions(
            device=plan.device, dtype="bfloat16", max_batch_size=rows, batch_wait_ms=0.0
        )
        loaded = time.perf_counter()
        engine = TorchInferenceEngine(self.resolved_model(), options=options, seed=0)
        load_s = time.perf_counter() - loaded
        rng = np.random.default_rng(2)
        shared = rng.integers(0, plan.token_ids, plan.sample_shared_len).tolist()
        rest = plan.sample_prompt_len - plan.sample_shared_len
        prompts = [
            shared + rng.integers(0, plan.token_ids, rest).tolist()
            for _ in range(plan.sample_prompts)
        ]
        params = SamplingParams(max_tokens=plan.sample_new_tokens, stop=[], temperature=1.0)

        try:
            warm_up_s, runs, differences = asyncio.run(
                asyncio.wait_for(
                    self.sample_runs(engine, prompts, params), max(60.0, self.remaining_s())
                )
            )
        finally:
            del engine
            self.release_cuda()
        expected = rows * plan.sample_new_tokens
        seconds = statistics.median(s for s, _ in runs)
        return {
            "engine": "plait-torch",
            "device": plan.device,
            "dtype": "bfloat16",
            "load_seconds": round(load_s, 2),
            "warm_up_seconds": round(warm_up_s, 2),
            "prompts": plan.sample_prompts,
            "samples_per_prompt": plan.sample_n,
            "prompt_len": plan.sample_prompt_len,
            "shared_prefix_len": plan.sample_shared_len,
            "new_tokens": plan.sample_new_tokens,
            "run_seconds": [round(s, 3) for s, _ in runs],
            "tokens_per_run": [t for _, t in runs],
            "tokens_per_s": round(expected / seconds, 1),
            "logprob_vs_forward": {
                "tokens": len(differences),
                "mean_abs_difference": float(np.mean(differences)),
                "max_abs_difference": float(np.max(differences)),
            },
            **self.cuda_memory(),
            # bfloat16 noise: about 1e-3 on the CPU; an ignored KV cache gives about 0.3.
            "ok": all(tokens == expected for _, tokens in runs)
            and float(np.mean(differences)) < SAMPLED_LOGPROB_TOLERANCE,
        }

    async def sample_runs(
        self, engine: Any, prompts: list[list[int]], params: Any
    ) -> tuple[float, list[tuple[float, int]], list[float]]:
        """Seconds of a warm-up request, (seconds, tokens) of each run (every prompt's sample_n
        samples requested together, as a rollout step does), and |sampled logprob - logprob of
        the whole sequence in one forward| of the first sample of two prompts: the KV cache at
        work (a cache that is ignored gives differences of tenths)."""
        from plait.types import ModelInput, SamplingParams

        try:
            started = time.perf_counter()
            await engine.sample(
                ModelInput.from_ints(prompts[0]), 1, SamplingParams(max_tokens=4, stop=[])
            )
            warm_up = time.perf_counter() - started
            runs, responses = [], []
            for _ in range(self.plan.sample_repeats):
                started = time.perf_counter()
                responses = await asyncio.gather(
                    *[
                        engine.sample(ModelInput.from_ints(p), self.plan.sample_n, params)
                        for p in prompts
                    ]
                )
                tokens = sum(len(s.tokens) for r in responses for s in r.sequences)
                runs.append((time.perf_counter() - started, tokens))
            differences: list[float] = []
            for prompt, response in zip(prompts[:2], responses[:2], strict=False):
                sequence = response.sequences[0]
                whole = await engine.compute_logprobs(
                    ModelInput.from_ints(prompt + list(sequence.tokens))
                )
                reference = np.asarray(whole[len(prompt) :], dtype=np.float64)
                sampled = np.asarray(sequence.logprobs, dtype=np.float64)
                differences.extend(np.abs(sampled - reference).tolist())
            return warm_up, runs, differences
        finally:
            await engine.close()

    def fsdp2(self) -> dict[str, Any]:
        from plait.types import AdamParams
        from plait_fsdp2.engine import FSDP2Trainer
        from plait_fsdp2.options import FSDP2Options
        from plait_fsdp2.rank import use_cuda

        self.release_cuda()
        # A rank that does not start (an NCCL set-up that hangs) must not take the whole budget.
        timeout_s = max(60.0, min(self.plan.budget_s / 3, self.remaining_s()))
        options = FSDP2Options(
            world_size=1,
            device=self.plan.device,
            micro_batch_tokens=self.plan.micro_batch_tokens,
            start_timeout_s=timeout_s,
            call_timeout_s=timeout_s,
        )
        started = time.perf_counter()
        trainer = FSDP2Trainer(self.resolved_model(), options=options, seed=0)
        start_s = time.perf_counter() - started
        try:
            data, loss = self.workloads()["sft"]
            first, timings = self.train_steps(
                trainer.forward_backward,
                trainer.optim_step,
                data,
                loss,
                AdamParams(learning_rate=1e-5),
            )
            workload = self.throughput(timings, first, data)
        finally:
            trainer.close()
        peak = max(self.peaks) if self.peaks else trainer.peak_flops_per_s
        workload["mfu"] = round(workload.pop("model_flops_per_s") / peak, 4)
        result: dict[str, Any] = {
            "engine": "plait-fsdp2",
            "world_size": 1,
            "backend": "nccl" if use_cuda(options) else "gloo",
            "start_seconds": round(start_s, 2),
            "sft": workload,
        }
        if self.sft_first_loss is not None:  # same weights, same data: the same loss
            difference = abs(first - self.sft_first_loss) / abs(self.sft_first_loss)
            result["first_loss_vs_plait_torch"] = {
                "fsdp2": first,
                "plait_torch": self.sft_first_loss,
                "relative_difference": difference,
            }
            result["ok"] = difference < 1e-2
        return result

    def grpo(self) -> dict[str, Any]:
        run_dir = self.work / "runs"
        device = self.plan.device
        overrides = [
            f"run.out_dir={run_dir}",
            f"model.name={self.plan.grpo_model}",
            f"trainer.options.device={device}",
            f"inference.options.device={device}",
            'metrics.sinks=["jsonl", "console"]',
            *self.plan.grpo_overrides,
        ]
        command = [sys.executable, "-m", "plait.cli", "run", "examples/arith_tiny.toml"]
        command += ["--no-resume", *(arg for item in overrides for arg in ("-s", item))]
        done = self.run_command(
            command, "grpo", timeout_s=max(60.0, min(self.plan.budget_s / 2, self.remaining_s()))
        )
        result: dict[str, Any] = {
            "config": "examples/arith_tiny.toml",
            "model": self.plan.grpo_model,
            "overrides": overrides,
            **done,
        }
        files = list(run_dir.glob("*/metrics.jsonl"))
        if not files:
            return {**result, "ok": False, "error": "the run wrote no metrics.jsonl"}
        rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
        steps = [row for row in rows if "reward/mean" in row]
        keys = ("time/total", "time/rollout", "time/train", "time/sync")
        result.update(
            steps=len(steps),
            rewards=[round(row["reward/mean"], 4) for row in steps],
            eval_accuracy=[row["eval/accuracy"] for row in rows if "eval/accuracy" in row],
            step_seconds_median={
                key: round(statistics.median(row[key] for row in steps), 3)
                for key in keys
                if steps and all(key in row for row in steps)
            },
            mfu=[round(row["perf/mfu"], 5) for row in steps if "perf/mfu" in row],
        )
        expected = int(next(o for o in overrides if o.startswith("rl.steps=")).split("=")[1])
        result["ok"] = done["returncode"] == 0 and len(steps) == expected
        return result

    def pytest_gpu(self) -> dict[str, Any]:
        files = gpu_test_files()
        command = [sys.executable, "-m", "pytest", *map(str, files), "-m", "gpu", "-q", "-rs"]
        command += ["-p", "no:cacheprovider", f"--basetemp={self.work / 'pytest'}"]
        done = self.run_command(command, "pytest_gpu", timeout_s=max(60.0, self.remaining_s()))
        counts = pytest_counts(done.get("output_tail", ""))
        return {
            "files": [str(f.relative_to(REPO)) for f in files],
            **counts,
            **done,
            # Without CUDA every gpu test skips; with it, none may fail.
            "ok": done["returncode"] == 0 and counts.get("failed", 0) == 0,
        }

    def run_command(self, command: Sequence[str], name: str, timeout_s: float) -> dict[str, Any]:
        """Run `command` in the repository, its output to <work>/<name>.log (and this log)."""
        log_path = self.work / f"{name}.log"
        self.log(f"{name}: {' '.join(command)} (timeout {timeout_s:.0f} s)")
        started = time.perf_counter()
        with log_path.open("w") as log_file:
            process = subprocess.Popen(
                command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, text=True
            )
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                returncode = process.wait()
                returncode = -9 if returncode == 0 else returncode
        output = log_path.read_text(errors="replace")
        print(output[-20000:], flush=True)
        return {
            "command": " ".join(command),
            "returncode": returncode,
            "timed_out": time.perf_counter() - started >= timeout_s,
            "output_tail": output[-3000:],
        }


def tflops(flops: float) -> float:
    return float(f"{flops / 1e12:.4g}")


def sft_batch(rng: np.random.Generator, rows: int, length: int, token_ids: int) -> list[Any]:
    """`rows` random sequences of `length` tokens; cross-entropy on every target, weights summing
    to 1 over the batch (plait losses are token sums)."""
    from plait.types import Datum, ModelInput

    weight = 1.0 / (rows * (length - 1))
    data = []
    for _ in range(rows):
        tokens = rng.integers(0, token_ids, length).tolist()
        data.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]),
                {"target_tokens": tokens[1:], "weights": [weight] * (length - 1)},
            )
        )
    return data


def rl_batch(
    rng: np.random.Generator,
    groups: int,
    group_size: int,
    prompt_len: int,
    completion_len: int,
    token_ids: int,
) -> list[Any]:
    """GRPO-shaped data: `groups` prompts with `group_size` completions each, advantages of mean 0
    on the completion tokens (scaled by the batch's completion tokens), the sampler's logprobs
    those of a uniform guess."""
    from plait.types import Datum, ModelInput

    scale = 1.0 / (groups * group_size * completion_len)
    guess = -float(np.log(token_ids))
    data = []
    for _ in range(groups):
        prompt = rng.integers(0, token_ids, prompt_len).tolist()
        advantages = rng.standard_normal(group_size)
        advantages -= advantages.mean()
        for advantage in advantages:
            tokens = prompt + rng.integers(0, token_ids, completion_len).tolist()
            on_completion = [0.0] * (prompt_len - 1) + [1.0] * completion_len
            data.append(
                Datum(
                    ModelInput.from_ints(tokens[:-1]),
                    {
                        "target_tokens": tokens[1:],
                        "logprobs": [guess * a for a in on_completion],
                        "advantages": [float(advantage) * scale * a for a in on_completion],
                    },
                )
            )
    return data


def gpu_test_files() -> list[Path]:
    """The test files that use the `gpu` marker."""
    marker = re.compile(r"pytest\.mark\.gpu\b")
    found = []
    for top in TEST_DIRS:
        for path in sorted((REPO / top).rglob("test_*.py")):
            if ".venv" in path.parts or "node_modules" in path.parts:
                continue
            if marker.search(path.read_text(errors="replace")):
                found.append(path)
    return found


def pytest_counts(output: str) -> dict[str, Any]:
    """Counts from pytest's closing line ("2 passed, 1 skipped in 3.2s")."""
    lines = [line for line in output.splitlines() if re.search(r"\bin [\d.]+s\b", line)]
    if not lines:
        return {}
    counts = {
        word: int(number)
        for number, word in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1]
        )
    }
    return {"counts": counts, "failed": counts.get("failed", 0) + counts.get("error", 0)}


def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as metadata

    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "megatron-core"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if device == "cuda" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_gib=round(properties.total_memory / 2.0**30, 1),
            multiprocessors=properties.multi_processor_count,
            capability=list(torch.cuda.get_device_capability(0)),
            nccl=str(torch.cuda.nccl.version()),
            # plait's output head runs in float32: TF32 would make it several times faster.
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        )
    return info


def summary(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers of the parts that have run."""

    def get(part: str, *keys: str) -> Any:
        value: Any = parts.get(part, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {
        "failed_parts": [name for name, part in parts.items() if not part["ok"]],
        "measured_bf16_peak_tflops": get("trainer", "measured_peak_tflops")
        or get("peak", "measured_tflops"),
        "trainer_mfu": get("trainer", "mfu"),
        "trainer_sft_tokens_per_s": get("trainer", "workloads", "sft", "tokens_per_s"),
        "trainer_grpo_tokens_per_s": get("trainer", "workloads", "grpo", "tokens_per_s"),
        "sampling_tokens_per_s": get("sampling", "tokens_per_s"),
        "fsdp2_backend": get("fsdp2", "backend"),
        "fsdp2_sft_tokens_per_s": get("fsdp2", "sft", "tokens_per_s"),
        "grpo_steps": get("grpo", "steps"),
        "grpo_rewards": get("grpo", "rewards"),
        "pytest_gpu": get("pytest_gpu", "counts"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--out", type=Path, required=True, help="where gpu_check.json goes")
    parser.add_argument("--work", type=Path, required=True, help="scratch: model, runs, logs")
    parser.add_argument("--setup-seconds", type=float, default=0.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    plan = dry_run_plan() if args.dry_run else gpu_plan()
    if plan.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device: run on the lent GPU machine, or pass --dry-run")
    check = Check(plan, args.out, args.work, args.dry_run, args.setup_seconds)
    check.log(
        f"plan: {plan.model_label} on {plan.device}; environment: {check.result['environment']}"
    )
    check.run_part("peak", check.peak)
    check.run_part("model", check.build_model)
    check.run_part("trainer", check.trainer)
    check.run_part("sampling", check.sampling)
    check.run_part("fsdp2", check.fsdp2)
    check.run_part("grpo", check.grpo)
    check.run_part("pytest_gpu", check.pytest_gpu)
    check.write()
    print(json.dumps(check.result["summary"], indent=1), flush=True)
    check.log(f"{'ok' if check.result['ok'] else 'FAILED'}; results in {args.out / RESULT_FILE}")
    sys.exit(0 if check.result["ok"] else 1)


if __name__ == "__main__":
    main()
