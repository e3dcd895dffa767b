"""plait-median-baseline: the "group_median" advantage estimator (an example plugin)."""
