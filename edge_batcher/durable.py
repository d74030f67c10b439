"""Making a renamed file survive power loss: the directory's entry written to disk too.

A file written, fsynced and renamed over another is durable only once its directory is fsynced
as well; before, a crash can bring back the old name or none. The document index
(rag/index.py) and TensorRT's built plans (engines/trt_builder.py) replace files this way on
devices whose usual way to stop is losing power.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """fsync `directory` (its entries); a file system that cannot open a directory is left as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
