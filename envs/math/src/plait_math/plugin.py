"""plait-math's plugin: registers the math environments lazily (nothing heavy is imported here)."""

from __future__ import annotations

from plait.api import RegisterEnv, hookimpl

ENVS = {
    "math.arith": (
        "plait_math.arith",
        "ArithOptions",
        "seeded arithmetic with difficulty knobs and a strict verifier",
    ),
    "math.gsm8k": (
        "plait_math.gsm8k",
        "Gsm8kOptions",
        "GSM8K word problems (test: the real GSM8K test split; train: reasoning-gym gsm_symbolic)",
    ),
    "math.calculator": (
        "plait_math.calculator_env",
        "CalculatorOptions",
        "multi-turn arithmetic with a safe calculator tool",
    ),
    "math.propose": (
        "plait_math.propose",
        "ProposeOptions",
        "two roles: a proposer writes a sum for a target, a solver solves it "
        "(multi-policy, self-play)",
    ),
    "reasoning_gym": (
        "plait_math.reasoning_gym_env",
        "ReasoningGymOptions",
        "reasoning-gym's procedural datasets, one or a weighted mixture, scored by reasoning-gym",
    ),
}


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    for name, (module, options, description) in ENVS.items():
        register(name, f"{module}:make_env", options=f"{module}:{options}", description=description)
