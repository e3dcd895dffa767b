"""plait-csv-sink: the "csv" metric sink (an example plugin)."""
