"""The training engine: models, data, trainer, telemetry and checkpoints (imports optim and torch only)."""
