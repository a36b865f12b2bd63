"""All SQL of the service."""
