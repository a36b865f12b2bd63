"""HTTP routes: thin, one module per resource."""
