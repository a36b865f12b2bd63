"""An exported checkpoint's names: its metadata key and the files ``muonforge export`` writes.

The safetensors metadata key (``EXPORT_KEY``) holds the model's config as JSON.
"""

from __future__ import annotations

EXPORT_KEY = "muonforge.model"
EXPORT_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
