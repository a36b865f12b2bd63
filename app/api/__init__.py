"""The HTTP edge of the service: request dependencies, limits before work, metrics, and the routes."""
