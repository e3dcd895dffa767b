"""plait-algorithms: advantage estimators and off-policy corrections, as registered components."""
