"""User-facing entry points: the ``muonforge`` CLI and the Python client."""
