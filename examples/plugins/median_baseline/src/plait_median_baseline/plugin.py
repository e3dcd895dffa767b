"""The plugin module (entry point `median_baseline`): registers the estimator by a lazy
target."""

from plait.api import RegisterAdvantage, hookimpl


@hookimpl
def plait_register_advantages(register: RegisterAdvantage) -> None:
    register(
        "group_median",
        "plait_median_baseline.estimator:group_median",
        options="plait_median_baseline.estimator:MedianOptions",
        description="r - the group's median reward (normalize: / mean |r - median|)",
    )
