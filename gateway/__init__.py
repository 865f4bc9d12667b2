"""The OpenAI-compatible gateway: tenants, API keys, routing to workers (no torch, no triton)."""
