from vf_v1_arith.taskset import VfV1ArithTaskset

__all__ = ["VfV1ArithTaskset"]
