"""plait-sdk's plugin module (CLI commands for environments are added here)."""
