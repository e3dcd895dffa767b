"""plait-math: verifiable math environments for plait (`math.arith`, `math.gsm8k`,
`math.calculator`).

Build one through the plugin registry (`plait.plugins.build("env", "math.arith", options={...})`) or
directly with `plait_math.arith.make_env(options=ArithOptions(...))`.
"""
