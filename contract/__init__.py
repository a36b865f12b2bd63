"""The contract every side of muonforge shares: statuses, the job spec, metric and event names.

Torch-free and server-free: the API, the worker's engine, the client and the web pages import it.
Each module is imported on its own (``contract.status`` needs only the standard library;
``contract.spec`` needs pydantic), so this package imports nothing itself.
"""
