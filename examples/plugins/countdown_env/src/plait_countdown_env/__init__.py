"""plait-countdown-env: the "countdown" environment (an example plugin written with plait-sdk)."""
