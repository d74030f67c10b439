"""Dynamic batching: queues (queues.py), the pure batching policy (policy.py), learned
execution times (timing.py) and the asyncio runner that drives engines (runner.py)."""
