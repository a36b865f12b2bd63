"""An exported checkpoint: the safetensors metadata key that holds its model's config, and the
files ``muonforge export`` writes."""

from __future__ import annotations

EXPORT_KEY = "muonforge.model"
EXPORT_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
