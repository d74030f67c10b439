"""edge-batcher: a memory-aware batching inference daemon for edge devices."""

__version__ = "0.1.0"
