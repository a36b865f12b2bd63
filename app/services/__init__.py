"""Use cases of the service; they never commit (the request or task that owns the session does)."""
