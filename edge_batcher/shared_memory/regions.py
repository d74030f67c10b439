"""The registry of system shared memory regions: a name -> one mmap of a POSIX shm object under
/dev/shm, with the daemon's rules checked at registration (a plain key, no path; a regular file
owned by the daemon's user or an allowed uid; offset and byte_size inside the file; bounded count
and bytes). A region in use by a request is reference-counted: unregistering it takes it out of
the registry at once, and its mapping is closed when the last request using it ends.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat

from ..errors import InvalidInput
from .named_regions import MAX_KEY_LENGTH, NamedRegions, RegionLimits, check_name

__all__ = ["Region", "RegionLimits", "RegionRegistry", "shm_path"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def shm_path(key: str) -> str:
    """The file under /dev/shm a POSIX shm key names ("/frames" or "frames"), or InvalidInput:
    one leading '/' at most, no other '/', no '..', nothing that leaves /dev/shm."""
    if not isinstance(key, str) or not key:
        raise InvalidInput("shared memory key must be a non-empty string such as \"/frames\"")
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or ".." in name or "\0" in name:
        raise InvalidInput(f"shared memory key {key!r} is not a POSIX shm name: one leading '/' at most, "
                           "then a name without '/' or '..' (the object lives in /dev/shm)")
    if len(name) > MAX_KEY_LENGTH:
        raise InvalidInput(f"shared memory key is longer than {MAX_KEY_LENGTH} characters")
    path = os.path.join(SHM_DIR, name)
    if os.path.dirname(os.path.normpath(path)) != SHM_DIR:  # belt and braces: never outside /dev/shm
        raise InvalidInput(f"shared memory key {key!r} resolves outside {SHM_DIR}")
    return path


class Region:
    """One registered region: its own descriptor (to re-check the file's size) and one mapping
    of [offset, offset + byte_size) of the file."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, allowed_uids: frozenset[int]):
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        path = shm_path(key)
        try:  # O_NOFOLLOW: a symlink planted in /dev/shm is refused, not followed
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidInput(f"shared memory region {name!r}: no shm object {key!r} ({path})") from None
        except OSError as exc:
            raise InvalidInput(f"shared memory region {name!r}: cannot open {key!r} read-write: "
                               f"{exc.strerror}") from None
        try:
            self._map = self._map_checked(allowed_uids)
        except BaseException:
            os.close(self._fd)
            raise
        self.users = 0  # requests holding it now
        self.registered = True

    @property
    def unused(self) -> bool:
        return self.users == 0 and not self.registered

    def _map_checked(self, allowed_uids: frozenset[int]) -> mmap.mmap:
        st = os.fstat(self._fd)
        where = f"shared memory region {self.name!r} (key {self.key!r})"
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{where}: not a regular shm object")
        if st.st_uid != os.geteuid() and st.st_uid not in allowed_uids:
            raise InvalidInput(f"{where}: owned by uid {st.st_uid}, not by the daemon's user ({os.geteuid()}) "
                               "or a uid in [server] shm_allowed_uids")
        if self.offset + self.byte_size > st.st_size:
            raise InvalidInput(f"{where}: offset {self.offset} + byte_size {self.byte_size} is beyond the "
                               f"object's {st.st_size} bytes")
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        self._skip = self.offset - start
        return mmap.mmap(self._fd, self._skip + self.byte_size, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)

    def view(self, offset: int, byte_size: int, where: str) -> memoryview:
        """byte_size bytes at `offset` within the region (InvalidInput when out of range). The
        file is checked to still hold them: a client that shrank it would otherwise crash the
        daemon with SIGBUS on the first read."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise InvalidInput(f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} "
                               f"is beyond region {self.name!r} ({self.byte_size} bytes)")
        if os.fstat(self._fd).st_size < self.offset + self.byte_size:
            raise InvalidInput(f"{where}: the shm object of region {self.name!r} was truncated below its "
                               "registered size; unregister and register it again")
        start = self._skip + offset
        return memoryview(self._map)[start:start + byte_size]

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view outlived its request (a batch still running): unmapped when it goes
            log.debug("region %r: mapping still viewed; it is unmapped when the last view is released", self.name)
        os.close(self._fd)

    def status(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class RegionRegistry(NamedRegions[Region]):
    """The daemon's system regions by name; used from the event loop and the decode threads alike."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        check_name(name)
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInput(f"shared memory region {name!r}: {what} must be an integer >= 0, got {value!r}")
        if byte_size == 0:
            raise InvalidInput(f"shared memory region {name!r}: byte_size must be > 0")
        with self._lock:
            self._check_room(name, byte_size)
        self._add(Region(name, key, offset, byte_size, self.limits.allowed_uids))  # opens and maps: outside the lock
        log.debug("registered shared memory region %r (key %r, %d bytes)", name, key, byte_size)

    def close(self) -> None:
        """At shutdown, after the drain: every region unmapped."""
        self.unregister(None)

    def _close(self, region: Region) -> None:
        region.close()
