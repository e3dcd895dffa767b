"""The base of inference engines that run in an HTTP server of their own, and its failure kit."""
