"""Request and response schemas of the HTTP API (the job spec is the contract's: contract.spec)."""
