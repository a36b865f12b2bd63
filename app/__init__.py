"""The FastAPI service and the domain it owns (settings, models, schemas, repositories, routes)."""
