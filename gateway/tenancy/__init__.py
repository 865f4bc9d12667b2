"""Tenants and what they may spend: API keys, quotas (Lua scripts on Redis), usage counters,
and scheduling weights."""
