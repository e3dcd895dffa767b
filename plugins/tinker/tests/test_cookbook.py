"""Unmodified tinker-cookbook 0.5.8 recipes against `plait serve tinker`, on local data, each a
short run whose loss falls or whose reward rises: chat_sl, then math_rl (env=arithmetic,
importance_sampling) from its state; sl_basic; rl_basic; prompt_distillation (train);
multiplayer_rl/guess_number.

Offline and unmodified: the recipes keep their default models where they can (guess_number takes
no model argument), and sl_basic and rl_basic load HF datasets by name. They run in a working
directory holding a directory of each such name, which `datasets.load_dataset("openai/gsm8k")`
and `AutoTokenizer.from_pretrained("Qwen/Qwen3.5-4B")` read before the hub; the server serves
each model name with tiny-qwen3.

tiny-qwen3 starts random, and a random policy never answers in an RL recipe's format (every
group would score alike and nothing would be learnt): the RL recipes get tiny-qwen3 primed with
their answer formats (cookbook_prime.py), the supervised ones start from random. The recipes run
in their own venv (scripts/ci/cookbook.sh: the cookbook pins transformers)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.api import ResolvedModel
from plait_testing.venvs import venv_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = Path(__file__).parents[3]
HERE = Path(__file__).parent

RAW = (  # served by tiny-qwen3
    "Qwen/Qwen3.5-9B-Base",  # sl_basic's default
    "Qwen/Qwen3.6-35B-A3B",  # prompt_distillation's default
)
PRIMED = (  # served by tiny-qwen3 primed with the RL recipes' formats
    "Qwen/Qwen3-8B-Base",  # rl_basic (model_name=...: role_colon, as for its default)
    "Qwen/Qwen3.5-4B",  # guess_number's default
)


def arithmetic_conversations(path: Path, count: int = 640) -> None:
    """The environment's shape: a worked example, then "What is x + y?" answered by the sum."""
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(count):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            out.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": "What is 4 + 5?"},
                            {"role": "assistant", "content": "9"},
                            {"role": "user", "content": f"What is {x} + {y}?"},
                            {"role": "assistant", "content": str(x + y)},
                        ]
                    }
                )
                + "\n"
            )


def metrics(log_path: Path, key: str) -> list[float]:
    rows = [
        json.loads(line)
        for line in (log_path / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [row[key] for row in rows if key in row]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def cookbook() -> str:
    return venv_python(
        "PLAIT_COOKBOOK_VENV", ROOT / ".venvs" / "cookbook", "bash scripts/ci/cookbook.sh"
    )


@pytest.fixture(scope="module")
def primed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the `primed` fixture writes the primed tiny-qwen3: the server loads a model at its
    first use, so it serves this directory before it exists."""
    return tmp_path_factory.mktemp("primed") / "tiny-qwen3"


@pytest.fixture(scope="module")
def workdir(
    tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: ResolvedModel, primed_dir: Path
) -> Path:
    """The recipes' working directory: their hub names as local directories, and their data."""
    work = tmp_path_factory.mktemp("cookbook")
    for name in RAW + PRIMED:  # the tokenizers the recipes load by model name
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).symlink_to(tiny_qwen3.path if name in RAW else primed_dir)
    # sl_basic: HuggingFaceH4/no_robots's train and test splits (its "messages" column)
    (work / "HuggingFaceH4/no_robots").mkdir(parents=True)
    arithmetic_conversations(work / "HuggingFaceH4/no_robots/train.jsonl", 256)
    arithmetic_conversations(work / "HuggingFaceH4/no_robots/test.jsonl", 8)
    # rl_basic: openai/gsm8k's config "main" ("question", and "answer" ending "#### <number>"),
    # a question whose answer the RL run has to find: the digit 7
    (work / "openai/gsm8k/main").mkdir(parents=True)
    (work / "openai/gsm8k/README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n"
        "  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n---\n"
    )
    rng = random.Random(0)
    for split, count in (("train", 256), ("test", 8)):
        with (work / f"openai/gsm8k/main/{split}.jsonl").open("w") as out:
            for _ in range(count):
                name = rng.choice(["Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal"])
                question = f"{name} thinks of a digit. Which digit is it?"
                answer = f"{name} thinks of 7.\n#### 7"
                out.write(json.dumps({"question": question, "answer": answer}) + "\n")
    # prompt_distillation: what its create_data writes (a sentence, then its language's code)
    languages = json.loads((HERE / "data" / "languages.json").read_text())
    with (work / "prompt_distillation_lang.jsonl").open("w") as out:
        for sentence, code in languages.items():
            convo = [{"role": "user", "content": sentence}, {"role": "assistant", "content": code}]
            out.write(json.dumps({"messages": convo}, ensure_ascii=False) + "\n")
    return work


@pytest.fixture(scope="module")
def primed(cookbook: str, tiny_qwen3: ResolvedModel, workdir: Path, primed_dir: Path) -> Path:
    """tiny-qwen3 trained (all weights, 32 steps) on the RL recipes' answer formats."""
    start = time.monotonic()
    script, questions = HERE / "cookbook_prime.py", workdir / "openai/gsm8k/main/train.jsonl"
    done = subprocess.run(
        [cookbook, str(script), str(tiny_qwen3.path), str(primed_dir), str(questions), "32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"primed in {time.monotonic() - start:.0f} s:", done.stdout.splitlines()[-1])
    return primed_dir


@pytest.fixture
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: ResolvedModel, primed_dir: Path
) -> Iterator[str]:
    """`plait serve tinker` in a process of its own, one for each test; its base URL."""
    tmp = tmp_path_factory.mktemp("server")
    served = {str(tiny_qwen3.path): tiny_qwen3.path}
    served |= {name: tiny_qwen3.path for name in RAW}
    served |= {name: primed_dir for name in PRIMED}
    config = tmp / "tinker.toml"
    config.write_text(
        f'[server]\nport = 0\nstorage = "{tmp / "storage"}"\n\n'
        + "".join(f'[models."{name}"]\nmodel = "{path}"\n\n' for name, path in served.items())
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "serve", "tinker", str(config)],
        stdout=subprocess.PIPE,
        stderr=(tmp / "server.log").open("w"),
        text=True,
    )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert " on " in line, (tmp / "server.log").read_text()[-3000:]
        yield line.split(" on ", 1)[1].split()[0]
    finally:
        process.terminate()
        process.wait(60)


def run_recipe(cookbook: str, recipe: str, args: list[str], cwd: Path, url: str) -> float:
    """Runs `tinker_cookbook.recipes.<recipe>` with `args` in `cwd`; its wall time."""
    env = {
        **os.environ,
        "TINKER_BASE_URL": url,  # for the recipes without a base_url argument
        "TINKER_API_KEY": "tml-local",
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cwd / ".hf"),  # the datasets cache, not the user's
    }
    start = time.monotonic()
    done = subprocess.run(
        [cookbook, "-m", f"tinker_cookbook.recipes.{recipe}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{recipe}:\n{done.stderr[-3000:]}"
    return time.monotonic() - start


def test_cookbook_recipes_learn_against_the_server(
    cookbook: str, server: str, tiny_qwen3: ResolvedModel, tmp_path: Path
) -> None:
    model = str(tiny_qwen3.path)
    common = [
        f"model_name={model}",
        "renderer_name=qwen3",
        "lora_rank=8",
        f"base_url={server}",
        "eval_every=0",
        "behavior_if_log_dir_exists=delete",
    ]
    arithmetic_conversations(tmp_path / "arith.jsonl")
    run_recipe(
        cookbook,
        "chat_sl.train",
        [
            *common,
            f"dataset={tmp_path / 'arith.jsonl'}",
            "batch_size=32",
            "max_steps=6",
            "learning_rate=5e-3",
            "lr_schedule=constant",
            "max_length=256",
            "train_on_what=last_assistant_message",
            "save_every=0",
            f"log_path={tmp_path / 'sl'}",
        ],
        tmp_path,
        server,
    )
    nll = metrics(tmp_path / "sl", "train_mean_nll")
    print("chat_sl train_mean_nll by step:", [round(v, 3) for v in nll])
    assert len(nll) == 6 and nll[-1] < nll[0] - 2.0, nll

    state = json.loads((tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()[-1])[
        "state_path"
    ]
    run_recipe(
        cookbook,
        "math_rl.train",
        [
            *common,
            "env=arithmetic",
            "loss_fn=importance_sampling",
            "group_size=8",
            "groups_per_batch=16",
            "max_steps=12",
            "learning_rate=2e-3",
            f"load_checkpoint_path={state}",
            "save_every=5",
            f"log_path={tmp_path / 'rl'}",
        ],
        tmp_path,
        server,
    )
    reward = metrics(tmp_path / "rl", "env/all/reward/total")
    print("math_rl env/all/reward/total by step:", [round(v, 4) for v in reward])
    print(
        "math_rl env/all/format by step:",
        [round(v, 3) for v in metrics(tmp_path / "rl", "env/all/format")],
    )
    assert len(reward) == 12 and sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.02, reward


def test_sl_basic(cookbook: str, server: str, workdir: Path, tmp_path: Path) -> None:
    """Its default model (Qwen/Qwen3.5-9B-Base, role_colon) and dataset (no_robots), 32 a batch
    instead of 128 (the builder is one argument, so all its settings are given). submit_ahead=0:
    the cookbook's supervised loop, one batch ahead, now and then waits 45 s for a result the
    server has sent (README); chat_sl and prompt_distillation run it so."""
    seconds = run_recipe(
        cookbook,
        "sl_basic",
        [
            "dataset_builder=tinker_cookbook.recipes.chat_sl.chat_datasets:NoRobotsBuilder",
            "dataset_builder.common_config.model_name_for_tokenizer=Qwen/Qwen3.5-9B-Base",
            "dataset_builder.common_config.renderer_name=role_colon",
            "dataset_builder.common_config.max_length=256",
            "dataset_builder.common_config.batch_size=32",
            "learning_rate=1e-2",
            "lr_schedule=constant",
            "lora_rank=8",
            "max_steps=8",
            "submit_ahead=0",
            "eval_every=0",
            "save_every=0",
            f"log_path={tmp_path / 'run'}",
        ],
        workdir,
        server,
    )
    nll = metrics(tmp_path / "run", "train_mean_nll")
    print(f"sl_basic ({seconds:.0f} s) train_mean_nll by step:", [round(v, 3) for v in nll])
    print(
        "sl_basic seconds by step:", [round(v, 1) for v in metrics(tmp_path / "run", "time/step")]
    )
    assert len(nll) == 8 and nll[-1] < nll[0] / 2, nll


def test_rl_basic(cookbook: str, server: str, workdir: Path, primed: Path, tmp_path: Path) -> None:
    """Its Gsm8kDatasetBuilder on the local openai/gsm8k, 8 groups of 8 a batch (128 of 16 by
    default) without the few-shot prefix, 16 tokens an answer: the primed model answers
    \\boxed{d} with d at random, and RL finds the 7 the data rewards."""
    seconds = run_recipe(
        cookbook,
        "rl_basic",
        [
            "model_name=Qwen/Qwen3-8B-Base",
            "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
            "dataset_builder.model_name_for_tokenizer=Qwen/Qwen3-8B-Base",
            "dataset_builder.renderer_name=role_colon",
            "dataset_builder.batch_size=8",
            "dataset_builder.group_size=8",
            "dataset_builder.convo_prefix=None",
            "max_tokens=16",
            "learning_rate=5e-3",
            "lora_rank=8",
            "max_steps=5",
            "save_every=0",
            f"log_path={tmp_path / 'run'}",
        ],
        workdir,
        server,
    )
    reward = metrics(tmp_path / "run", "env/all/reward/total")
    correct = metrics(tmp_path / "run", "env/all/correct")
    print(f"rl_basic ({seconds:.0f} s) env/all/reward/total:", [round(v, 3) for v in reward])
    print("rl_basic env/all/correct:", [round(v, 3) for v in correct])
    assert len(reward) == 5 and mean(reward[-2:]) > mean(reward[:2]) + 0.15, reward


def test_prompt_distillation(cookbook: str, server: str, workdir: Path, tmp_path: Path) -> None:
    """Its train step, default model (Qwen/Qwen3.6-35B-A3B, qwen3_5) and settings but the batch and
    the learning rate, on a file in its create_data's format. (create_data is not run: it keeps
    only the answers its teacher gives in the prompt's "Final Answer: xx" format, which a random
    tiny-qwen3 never does.)"""
    seconds = run_recipe(
        cookbook,
        "prompt_distillation.train",
        [
            f"file_path={workdir / 'prompt_distillation_lang.jsonl'}",
            "batch_size=8",
            "learning_rate=1e-2",
            "lr_schedule=constant",
            "lora_rank=8",
            "max_steps=8",
            "eval_every=0",
            "save_every=0",
            f"log_path={tmp_path / 'run'}",
        ],
        workdir,
        server,
    )
    nll = metrics(tmp_path / "run", "train_mean_nll")
    print(f"prompt_distillation ({seconds:.0f} s) train_mean_nll:", [round(v, 3) for v in nll])
    steps = [round(v, 1) for v in metrics(tmp_path / "run", "time/step")]
    print("prompt_distillation seconds by step:", steps)
    assert len(nll) == 8 and nll[-1] < nll[0] / 2, nll


def test_guess_number(
    cookbook: str, server: str, workdir: Path, primed: Path, tmp_path: Path
) -> None:
    """Its default model (Qwen/Qwen3.5-4B, qwen3_5_disable_thinking), 4 groups of 4 games a batch
    (32 of 8 by default): the primed model guesses in the game's format half the time, and each
    unparsed guess costs 1; the RL run learns to keep to the format. At 3e-3 over 5 steps it
    learned in some runs and fell apart in others (last steps at -6.8 from -4.6). At 1.5e-3 over 8
    steps of 2 groups (8 games), three runs climbed from about -5 to -2.5 (one lost it at the last
    step, -6.0) and one, in a bare CI run, only to -3.9 from -4.6: too noisy. With 4 groups (16
    games) two runs climbed steadily, -4.7 -> -1.75 and -4.8 -> -2.0, in about a minute. The test
    asks for the best three steps in a row after the first two, not the last three."""
    seconds = run_recipe(
        cookbook,
        "multiplayer_rl.guess_number.train",
        [
            "batch_size=4",
            "group_size=4",
            "learning_rate=1.5e-3",
            "max_tokens=16",
            "max_steps=8",
            "eval_every=0",
            "save_every=0",
            f"log_path={tmp_path / 'run'}",
        ],
        workdir,
        server,
    )
    reward = metrics(tmp_path / "run", "env/all/reward/total")
    print(f"guess_number ({seconds:.0f} s) env/all/reward/total:", [round(v, 3) for v in reward])
    best = max(mean(reward[i : i + 3]) for i in range(2, len(reward) - 2))
    assert len(reward) == 8 and best > mean(reward[:2]) + 1.0, reward
