"""Triton's system shared memory extension: regions a local client registers by POSIX shm key,
mapped once by the daemon (`regions.py`), and the per-request lease that reads inputs from them
and writes outputs into them (`lease.py`). Both HTTP and gRPC use the one registry the daemon
builds; docs/api.md ("Shared memory") states the rules."""
