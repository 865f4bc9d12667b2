"""The engine core: requests, the scheduler, the KV block pool and prefix cache, and the step."""
