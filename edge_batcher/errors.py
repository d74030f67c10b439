"""One exception tree for the whole daemon.

Core code raises these; each transport translates them at its edge (HTTP status, MQTT reply
user property) and nowhere else::

    EdgeBatcherError                  500  anything unexpected inside the daemon
    ├── ConfigError                   --   invalid configuration or model repository (start-up)
    ├── InvalidInput                  400  malformed payload, wrong shape/datatype, missing input
    │   └── PayloadTooLarge           413  request body over the configured limit
    ├── Unauthorized                  401  missing or wrong bearer token (TCP API)
    ├── RequestTimeout                408  the client did not send its whole request in body_timeout_s
    ├── ModelNotFound                 404  no such model in the repository
    ├── Overloaded                    429  queue full: rejected at once instead of growing
    ├── Unavailable                   503  model not ready, daemon draining, no peer
    │   └── DoesNotFit                503  not even the smallest batch fits device memory
    ├── DeadlineExceeded              504  the request's deadline passed before it could run
    ├── StorageError                  500  its own files could not be written (an index, a plan)
    │   └── StorageFull               507  ... for want of room on their file system
    └── EngineError                   500  the engine failed on a batch (the daemon keeps serving)
        └── OutOfMemory               500  the engine ran out of memory on a batch
"""

from __future__ import annotations

import errno


class EdgeBatcherError(Exception):
    """Root of every error the daemon raises on purpose."""

    status: int = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(EdgeBatcherError):
    """The configuration or a model.toml is invalid; the message names the key."""


class InvalidInput(EdgeBatcherError):
    status = 400


class PayloadTooLarge(InvalidInput):
    status = 413


class Unauthorized(EdgeBatcherError):
    status = 401


class RequestTimeout(EdgeBatcherError):
    status = 408


class ModelNotFound(EdgeBatcherError):
    status = 404


class Overloaded(EdgeBatcherError):
    status = 429


class Unavailable(EdgeBatcherError):
    status = 503


class DoesNotFit(Unavailable):
    """Not even the smallest batch of this request fits the device's memory budget."""


class DeadlineExceeded(EdgeBatcherError):
    status = 504


class StorageError(EdgeBatcherError):
    """The daemon could not write its own files (a document index, a TensorRT plan): a
    read-only file system, permissions. What was there stays as it was."""

    @staticmethod
    def of(what: str, exc: OSError, kept: str) -> StorageError:
        """`what` ("could not write X"), the file system's reason, and what was `kept`: StorageFull
        for want of room."""
        message = f"{what}: {exc.strerror or exc}; {kept}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFull(message + " (free some room there, then try again)")
        return StorageError(message)


class StorageFull(StorageError):
    """... for want of room (a full disk, a quota): WebDAV's 507 Insufficient Storage, which an
    operator can free."""

    status = 507


class EngineError(EdgeBatcherError):
    status = 500


class OutOfMemory(EngineError):
    """The engine reported out-of-memory for a batch; the runner splits and retries."""
