"""The training engine: models, data, the trainer, telemetry and checkpoints.

Of the project's packages it imports only contract and optim, never the service or the client
(tests/test_layers.py); it trains models with torch, without Celery.
"""
