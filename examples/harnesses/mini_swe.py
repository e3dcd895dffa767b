"""A bash agent on mini-swe-agent: `DefaultAgent` + `LocalEnvironment` + `LitellmModel`.

mini-swe-agent 2.x's LitellmModel offers the model one `bash` function tool (the ```bash-block
parsing of 1.x lives on as LitellmTextbasedModel) and runs each call's command in a fresh
subshell here; the agent ends when a command's output starts with the line
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT, and the rest of that output is its submission. The prompts
are the ones the `mini` command uses (config/mini.yaml). litellm's `openai/<model>` provider calls
POST {OPENAI_BASE_URL}/chat/completions with OPENAI_API_KEY.

    PLAIT_MODEL=m OPENAI_BASE_URL=http://HOST:PORT/s/SESSION/v1 OPENAI_API_KEY=x \
        .venvs/harness/bin/python examples/harnesses/mini_swe.py \
        "Compute 17*23 with python3 and submit it."

The prompt is PLAIT_PROMPT (else argv[1]). mini-swe-agent has no streaming mode (LitellmModel
calls litellm.completion without `stream`), so PLAIT_STREAM does nothing here. The submission is
the last line of stdout (empty when the agent ran out of steps). The commands run on this machine:
give it tasks you would run yourself.
"""

import os
import sys

# Offline-friendly defaults: litellm's bundled cost map instead of a download at import time, and
# no mini-swe-agent banner. The caller's values win.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import litellm
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

MAX_STEPS = 4
litellm.suppress_debug_info = True  # no "Provider List" banner when it cannot price the model


def main() -> None:
    prompt = os.environ.get("PLAIT_PROMPT") or sys.argv[1]
    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text())
    # a model litellm has no price for would make every call fail its cost check: price it at 0
    model = LitellmModel(
        model_name=f"openai/{os.environ['PLAIT_MODEL']}",
        cost_tracking="ignore_errors",
        **config["model"],
    )
    env = LocalEnvironment(**config["environment"])
    agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": MAX_STEPS})
    result = agent.run(prompt)
    print(result.get("submission", "").strip())


if __name__ == "__main__":
    main()
