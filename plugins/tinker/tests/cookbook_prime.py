"""Primes tiny-qwen3 for test_cookbook.py's RL recipes; runs in the cookbook's venv.

A random model never answers in a recipe's format, so every rollout of an RL recipe would score
alike and nothing would be learnt. This trains all of tiny-qwen3's weights (plain torch) on the
formats alone, rendered by the cookbook's own renderers from the recipes' own prompts, each
answer drawn at random:

- rl_basic (math_env.MathEnv, role_colon): "<question> Write your answer in \\boxed{} format."
  -> "\\boxed{d}", d a random digit: the RL run then finds the digit the data rewards;
- multiplayer_rl/guess_number (qwen3_5_disable_thinking): its system prompt and 0-2 earlier turns
  -> "Guess: n" or, as often, "Guess n" (which the game does not parse, and scores -1), n
  random: the RL run then learns the colon.

    python cookbook_prime.py BASE DEST QUESTIONS STEPS

QUESTIONS: the rl_basic data's openai/gsm8k train.jsonl.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.math_env import MathEnv
from tinker_cookbook.recipes.multiplayer_rl.guess_number.env import FAIL_TO_PARSE, SYSTEM_PROMPT
from tinker_cookbook.renderers import Message, TrainOnWhat
from tinker_cookbook.tokenizer_utils import get_tokenizer
from transformers import AutoModelForCausalLM


def main(base: Path, dest: Path, questions_file: Path, steps: int) -> None:
    rng = random.Random(0)
    tokenizer = get_tokenizer(str(base))
    colon = renderers.get_renderer("role_colon", tokenizer)
    qwen = renderers.get_renderer("qwen3_5_disable_thinking", tokenizer)
    questions = [json.loads(line)["question"] for line in questions_file.read_text().splitlines()]

    def math() -> tuple[renderers.Renderer, list[Message]]:
        question = rng.choice(questions) + MathEnv.question_suffix()
        answer = f"\\boxed{{{rng.randrange(10)}}}"
        return colon, [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]

    def guess() -> tuple[renderers.Renderer, list[Message]]:
        def turn() -> str:
            return rng.choice(["Guess: {}", "Guess {}"]).format(rng.randrange(1024))

        convo: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}]
        for _ in range(rng.randrange(3)):  # earlier turns, answered as the game answers them
            said = turn()
            feedback = rng.choice(["Too low", "Too high"]) if ":" in said else FAIL_TO_PARSE
            convo += [{"role": "player", "content": said}, {"role": "user", "content": feedback}]
        return qwen, [*convo, {"role": "assistant", "content": turn()}]

    torch.manual_seed(0)
    torch.set_num_threads(1)  # small ops: a second thread waits more than it helps (3x here)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = time.time()
    for step in range(steps):
        rows = []
        for renderer, convo in [task() for task in (math, guess) for _ in range(16)]:
            tokens, weights = renderer.build_supervised_example(
                convo, train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE
            )
            rows.append((tokens.to_ints(), weights.tolist()))
        width = max(len(tokens) for tokens, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (tokens, weights) in enumerate(rows):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            mask[i, : len(tokens)] = torch.tensor(weights) > 0
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        trained = mask[:, 1:]  # the output head only where the loss acts
        logits = model.lm_head(hidden[trained])
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][trained])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.3f} ({time.time() - start:.1f} s)", flush=True)
    model.save_pretrained(str(dest))
    for item in base.iterdir():
        if item.name.startswith(("tokenizer", "vocab", "merges")):
            shutil.copy(item, dest / item.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
