"""The plugin module (entry point `csv_sink`): registers the sink by a lazy target."""

from plait.api import RegisterMetricSink, hookimpl


@hookimpl
def plait_register_metric_sinks(register: RegisterMetricSink) -> None:
    register(
        "csv",
        "plait_csv_sink.sink:CsvSink",
        options="plait_csv_sink.sink:CsvOptions",
        description="metrics.csv in the run directory, one row per step, columns widening as "
        "metrics appear",
    )
