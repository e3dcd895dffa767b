"""plait's components as services over HTTP (see README.md). Importing this package imports no
web framework and no engine."""
