"""An exported checkpoint's names: its metadata key and the files ``muonforge export`` writes.

The safetensors metadata key (``EXPORT_KEY``) holds the model's config as JSON. A transformers
export (``format=hf``) is a directory of ``CONFIG_FILE`` (transformers' config), ``EXPORT_FILE``
(transformers' tensor names), ``GENERATION_FILE`` and, where the job's text has a tokenizer,
``TOKENIZER_FILES``.
"""

from __future__ import annotations

EXPORT_KEY = "muonforge.model"
EXPORT_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
FORMATS = ("safetensors", "hf")  # what ``muonforge export --format`` asks the API for
