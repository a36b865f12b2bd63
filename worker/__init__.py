"""Celery app and thin training tasks; ``worker.engine`` trains models without Celery."""
