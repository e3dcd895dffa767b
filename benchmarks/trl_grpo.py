"""TRL's side of benchmarks/vs_trl.py: the GRPO step of benchmarks/grpo_workload.py with TRL's
GRPOTrainer.

Runs inside the TRL venv (scripts/bench/trl_venv.sh), so it imports nothing of plait: the model
directory, the tasks (JSON lines of chat messages + answer, from grpo_workload.write_tasks) and the
workload's numbers all come on the command line. Writes per-step wall time and mean reward as JSON.

    .venvs/trl/bin/python benchmarks/trl_grpo.py --model DIR --tasks tasks.jsonl --steps 10
        --out trl.json

One optimizer step = 8 prompts x 8 completions generated together by transformers' `generate` (no
vLLM) on the CPU in float32, rewarded by the strict check, GRPO advantages, forward/backward over
the 64 completions in micro-batches of --micro-batch completions (gradient accumulation 64 /
micro-batch, steps_per_generation the same, so the one generation batch feeds exactly one optimizer
step and TRL computes no separate old logprobs; the "dapo" loss divides by the tokens of the whole
accumulated batch, so the update does not depend on the micro-batch), grad clip, AdamW.
--micro-batch 64 is gradient accumulation 1: one forward/backward over all 64 full sequences, which
went past 16 GB of memory on the CPU for this workload (16 takes ~7 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any


def strict_reward(
    completions: list[list[dict[str, str]]], answer: list[str], **_: Any
) -> list[float]:
    """grpo_workload.reward: the reply, stripped, is the number and nothing else."""
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="the checkpoint directory")
    parser.add_argument("--tasks", type=Path, required=True, help="JSON lines {messages, answer}")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2 (plait's default)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=16,
        help="completions per forward/backward (64 = no gradient accumulation)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    args = parser.parse_args()

    start = time.perf_counter()
    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["messages"], "answer": r["answer"]} for r in rows]
    )

    batch = args.groups * args.group_size
    if batch % args.micro_batch:
        raise SystemExit(
            f"--micro-batch {args.micro_batch} does not divide the {batch} completions of a step"
        )
    accumulation = batch // args.micro_batch
    config = trl.GRPOConfig(
        output_dir=str(args.out.parent / "trl-output"),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,  # completions per forward/backward
        gradient_accumulation_steps=accumulation,
        # one generation batch (8 prompts x 8) per optimizer step
        steps_per_generation=accumulation,
        num_generations=args.group_size,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,  # off (transformers would otherwise fall back to its default 50)
        min_p=None,
        repetition_penalty=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=args.beta2,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=args.grad_clip,
        beta=0.0,  # no KL term and so no reference model: plait's loss has none
        loss_type="dapo",  # token-level mean over the batch, as plait scales its advantages
        scale_rewards="group",  # (r - mean) / (std + eps) per group
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, rewards, forward/backward, clip, AdamW) and
        the logged metrics of each step."""

        def __init__(self) -> None:
            self.begun = self.begun_cpu = 0.0
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.begun, self.begun_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.seconds.append(time.perf_counter() - self.begun)
            self.cpu_seconds.append(time.process_time() - self.begun_cpu)

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any
        ) -> None:
            if logs and "reward" in logs:
                self.logs.append(
                    {
                        "step": state.global_step,
                        **{k: v for k, v in logs.items() if isinstance(v, int | float)},
                    }
                )

    timer = StepTimer()
    trainer = trl.GRPOTrainer(
        model=str(args.model),
        reward_funcs=strict_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
    )
    # The rollout part of a step: generation, rewards and advantages (once per optimizer step here).
    rollout_seconds: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a: Any, **kw: Any) -> Any:
        begun = time.perf_counter()
        out = generate_and_score(*a, **kw)
        rollout_seconds.append(time.perf_counter() - begun)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    setup_seconds = time.perf_counter() - start
    trainer.train()
    model = trainer.model
    result = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
            "python": platform.python_version(),
        },
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "model_dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
        "activation_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "generation_config": {
            k: getattr(trainer.generation_config, k, None)
            for k in (
                "max_new_tokens",
                "do_sample",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "eos_token_id",
            )
        },
        "batch": {
            "generation_batch_size": config.generation_batch_size,
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "steps_per_generation": config.steps_per_generation,
            "num_generations": config.num_generations,
        },
        "setup_seconds": setup_seconds,
        "total_seconds": time.perf_counter() - start,
        "step_seconds": timer.seconds,
        "step_cpu_seconds": timer.cpu_seconds,  # all threads of the process
        "rollout_seconds": rollout_seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "reward_by_step": [log["reward"] for log in timer.logs],
        "logs": timer.logs,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
