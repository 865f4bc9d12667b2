"""The engine's core: requests, KV blocks and the prefix cache, the scheduler and its
policies, and the settings. It imports nothing of the engine above it."""
