"""The shared memory registry's rules, on real POSIX shm objects in /dev/shm: which keys open,
whose objects register, ranges and limits, and a region unregistered while a request holds it."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from edge_batcher.errors import InvalidInput, Overloaded
from edge_batcher.shared_memory.lease import Lease
from edge_batcher.shared_memory.regions import RegionLimits, RegionRegistry, shm_path


@pytest.fixture
def shm_object():
    """A /dev/shm object of 4096 bytes owned by this user; yields its key."""
    made: list[str] = []

    def make(size: int = 4096) -> str:
        key = f"/eb-test-{uuid.uuid4().hex[:12]}"
        fd = os.open(shm_path(key), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)
        made.append(key)
        return key

    yield make
    for key in made:
        try:
            os.unlink(shm_path(key))
        except FileNotFoundError:
            pass


@pytest.mark.parametrize("key", ["", "/", "//x", "/a/b", "a/b", "/..", "..", "/x..y", "/.", "/\0x", "/" + "k" * 300])
def test_keys_that_are_not_a_plain_shm_name_are_refused(key):
    with pytest.raises(InvalidInput, match="key"):
        shm_path(key)


def test_a_plain_key_is_a_file_in_dev_shm():
    assert shm_path("/frames") == "/dev/shm/frames" == shm_path("frames")


def test_register_maps_the_object_and_a_lease_reads_it_without_copying(shm_object):
    key = shm_object()
    data = np.arange(4096, dtype=np.uint8)
    with open(shm_path(key), "r+b") as f:
        f.write(data.tobytes())
    registry = RegionRegistry()
    registry.register("r", key, 1024, 2048)
    assert registry.status() == [{"name": "r", "key": key, "offset": 1024, "byte_size": 2048}]
    with Lease(registry) as lease:
        array = lease.read_input("x", "UINT8", [2, 512], {"shared_memory_region": "r", "shared_memory_offset": 512,
                                                     "shared_memory_byte_size": 1024}, "input 'x'")
        np.testing.assert_array_equal(array.reshape(-1), data[1536:2560])
        assert not array.flags.writeable and not array.flags.owndata  # a read-only view of the mapping
    registry.close()
    assert registry.status() == []


@pytest.mark.parametrize("offset, size, match", [
    (0, 4097, "beyond the object's 4096 bytes"),
    (4000, 100, "beyond the object's 4096 bytes"),
    (-1, 10, "offset must be an integer"),
    (0, 0, "byte_size must be > 0"),
    (0, "10", "byte_size must be an integer"),
])  # fmt: skip
def test_offsets_and_sizes_outside_the_object_are_refused(shm_object, offset, size, match):
    with pytest.raises(InvalidInput, match=match):
        RegionRegistry().register("r", shm_object(), offset, size)


def test_unknown_key_duplicate_name_and_symlinks_are_refused(shm_object, tmp_path):
    registry = RegionRegistry()
    with pytest.raises(InvalidInput, match="no shm object"):
        registry.register("r", "/eb-test-does-not-exist", 0, 16)
    key = shm_object()
    registry.register("r", key, 0, 16)
    with pytest.raises(InvalidInput, match="already registered"):
        registry.register("r", key, 0, 16)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    link = shm_path(f"/eb-test-link-{uuid.uuid4().hex[:8]}")
    os.symlink(secret, link)
    try:
        with pytest.raises(InvalidInput, match="cannot open"):
            registry.register("s", "/" + os.path.basename(link), 0, 16)  # a symlink is never followed
    finally:
        os.unlink(link)
    registry.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_objects_of_other_users_register_only_when_their_uid_is_allowed(shm_object):
    key = shm_object()
    os.chown(shm_path(key), 12345, -1)
    with pytest.raises(InvalidInput, match="owned by uid 12345"):
        RegionRegistry().register("r", key, 0, 16)
    allowed = RegionRegistry(RegionLimits(allowed_uids=frozenset({12345})))
    allowed.register("r", key, 0, 16)
    allowed.close()


def test_the_count_and_bytes_of_regions_are_bounded(shm_object):
    registry = RegionRegistry(RegionLimits(max_regions=2, max_bytes=6000))
    registry.register("a", shm_object(), 0, 4000)
    with pytest.raises(Overloaded, match="shm_max_bytes"):
        registry.register("b", shm_object(), 0, 4000)
    registry.register("b", shm_object(), 0, 1000)
    with pytest.raises(Overloaded, match="shm_max_regions"):
        registry.register("c", shm_object(), 0, 10)
    registry.unregister("a")
    registry.register("c", shm_object(), 0, 10)
    registry.close()


def test_a_region_unregistered_while_a_request_holds_it_stays_mapped_until_the_request_ends(shm_object):
    key = shm_object()
    with open(shm_path(key), "r+b") as f:
        f.write(bytes([7]) * 4096)
    registry = RegionRegistry()
    registry.register("r", key, 0, 4096)
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 4096}
    with Lease(registry) as lease:
        array = lease.read_input("x", "UINT8", [4096], params, "input 'x'")
        registry.unregister("r")
        assert registry.status() == []  # gone for new requests at once
        with pytest.raises(InvalidInput, match="no shared memory region 'r'"):
            Lease(registry).read_input("x", "UINT8", [4096], params, "input 'y'")
        assert int(array.sum()) == 7 * 4096  # still readable: mapped until the lease ends
        assert key in open("/proc/self/maps").read()
        del array
    assert key not in open("/proc/self/maps").read()  # unmapped when it ended


def test_a_truncated_object_is_refused_instead_of_crashing_the_daemon(shm_object):
    key = shm_object()
    registry = RegionRegistry()
    registry.register("r", key, 0, 4096)
    os.truncate(shm_path(key), 100)  # reading past the end of the file would be SIGBUS
    with Lease(registry) as lease, pytest.raises(InvalidInput, match="truncated"):
        lease.read_input("x", "UINT8", [4096], {"shared_memory_region": "r", "shared_memory_byte_size": 4096}, "input")
    registry.close()


@pytest.mark.parametrize("params, shape, match", [
    ({"shared_memory_region": "r"}, [16], "shared_memory_byte_size must be an integer >= 0, got None"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 8}, [16], "does not match shape"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": 4090}, [16],
     "beyond region 'r'"),
    ({"shared_memory_region": 5, "shared_memory_byte_size": 16}, [16], "must be a string"),
    ({"shared_memory_region": "nope", "shared_memory_byte_size": 16}, [16], "no shared memory region 'nope'"),
])  # fmt: skip
def test_malformed_input_parameters_are_named(shm_object, params, shape, match):
    registry = RegionRegistry()
    registry.register("r", shm_object(), 0, 4096)
    with Lease(registry) as lease, pytest.raises(InvalidInput, match=match):
        lease.read_input("x", "UINT8", shape, params, "input 'x'")
    registry.close()
