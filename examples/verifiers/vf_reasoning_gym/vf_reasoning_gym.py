"""reasoning-gym datasets as a verifiers SingleTurnEnv, item for item those of plait's
`reasoning_gym` environment given the same options: each split is reasoning-gym's composite of
the datasets (train seeded `seed`, eval `seed + num_train_examples`), the prompt is the system
prompt, `few_shot` worked examples (the first train items, answered in tags) and the question,
and the reward is the dataset's own scorer on the answer verifiers' XMLParser reads (as verifiers'
own ReasoningGymEnv scores)."""

import functools
import json

import reasoning_gym
import verifiers as vf
from datasets import Dataset
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.utils import SYSTEM_PROMPTS


@functools.cache
def _composite(datasets_json: str, size: int, seed: int):
    """The split's composite (made once; keyed by the datasets' JSON, as a dict is unhashable)."""
    specs = [
        DatasetSpec(name, spec.get("weight", 1.0), spec.get("config", {}))
        for name, spec in json.loads(datasets_json).items()
    ]
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)


def load_environment(
    datasets: dict,
    seed: int = 0,
    num_train_examples: int = 1000,
    num_eval_examples: int = 100,
    system_prompt: str = "default",
    few_shot: int = 0,
) -> vf.Environment:
    specs = json.dumps(datasets)
    splits = {
        "train": (num_train_examples, seed),
        "eval": (num_eval_examples, seed + num_train_examples),
    }

    def rows(split: str) -> list[dict]:
        size, split_seed = splits[split]
        items = _composite(specs, size, split_seed)
        return [
            {
                "question": item["question"],
                "answer": item["answer"],
                "info": {"split": split, "index": i},
            }
            for i, item in enumerate(items)
        ]

    train = _composite(specs, *splits["train"])
    shots = [
        message
        for item in (train[i] for i in range(few_shot))
        for message in (
            {"role": "user", "content": item["question"]},
            {"role": "assistant", "content": f"<answer>{item['answer']}</answer>"},
        )
    ]
    parser = vf.XMLParser(fields=["answer"])

    def reasoning_gym_score(completion, info) -> float:
        items = _composite(specs, *splits[info["split"]])
        answer = parser.parse_answer(completion)
        return float(items.score_answer(answer=answer, entry=items[info["index"]]))

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows("train")),
        eval_dataset=Dataset.from_list(rows("eval")),
        system_prompt=SYSTEM_PROMPTS.get(system_prompt, system_prompt),
        few_shot=shots,
        parser=parser,
        rubric=vf.Rubric(funcs=[reasoning_gym_score], weights=[1.0], parser=parser),
    )
