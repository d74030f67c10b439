"""MemoryBudget arithmetic with a FixedProbe and a hand-driven clock."""

from __future__ import annotations

import pytest

from edge_batcher.errors import ConfigError
from edge_batcher.memory.budget import PRIORITY_AFTER_S, WAIT_LEASE_S, MemoryBudget
from edge_batcher.memory.probe import FixedProbe


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def budget(probe: FixedProbe, clock: Clock, **kwargs: object) -> MemoryBudget:
    options: dict[str, object] = {"reserve_fraction": 0.1, "headroom_bytes": 50}
    options.update(kwargs)
    return MemoryBudget(probe, clock=clock, **options)  # type: ignore[arg-type]


def test_available_is_free_minus_reserve_and_headroom() -> None:
    probe = FixedProbe(1000, total_bytes=2000)
    b = budget(probe, Clock())
    assert b.snapshot is None
    # 1000 free - 0.1 x 2000 total - 50 headroom
    assert b.available() == 750
    assert b.snapshot is not None and b.snapshot.free_bytes == 1000


def test_probe_is_read_at_most_once_per_refresh_interval() -> None:
    probe = FixedProbe(1000, total_bytes=2000)
    clock = Clock()
    b = budget(probe, clock, refresh_interval_s=1.0)
    assert b.available() == 750 and probe.reads == 1

    probe.free_bytes = 600
    clock.now = 0.5
    assert b.available() == 750  # cached figure, no read
    assert b.available() == 750
    assert probe.reads == 1

    clock.now = 1.0
    assert b.available() == 600 - 200 - 50
    assert probe.reads == 2

    probe.free_bytes = 800
    clock.now = 1.2
    assert b.available() == 350  # still cached...
    snap = b.refresh()  # ...until a load change forces a read
    assert snap.free_bytes == 800 and probe.reads == 3
    assert b.available() == 550 and probe.reads == 3


def test_zero_interval_reads_every_time() -> None:
    probe = FixedProbe(1000, total_bytes=2000)
    b = budget(probe, Clock(), refresh_interval_s=0)
    b.available()
    b.available()
    assert probe.reads == 2


def test_reserve_and_release() -> None:
    probe = FixedProbe(1000, total_bytes=2000)
    b = budget(probe, Clock())
    b.reserve(300)
    assert b.reserved == 300
    assert b.available() == 450
    b.reserve(500)
    assert b.available() == 0  # 750 - 800, never negative
    b.release(500)
    assert b.available() == 450
    with pytest.raises(ValueError, match="exceeds"):
        b.release(301)
    b.release(300)
    assert b.available() == 750 and b.reserved == 0

    assert not b.try_reserve(751)
    assert b.try_reserve(750)
    assert b.available() == 0
    b.release(750)

    with b.reservation(700):
        assert b.available() == 50
    assert b.available() == 750
    with pytest.raises(RuntimeError):
        with b.reservation(100):
            raise RuntimeError("batch failed")
    assert b.reserved == 0

    with pytest.raises(ValueError, match="nbytes"):
        b.reserve(-1)


class HostProbe(FixedProbe):
    """Plays a probe of host memory (cpu, jetson), moved by hand: its free figure falls when the
    process allocates."""

    name = "cpu"


def test_a_reservation_allocated_where_the_probe_sees_it_is_counted_once() -> None:
    probe = HostProbe(1000, total_bytes=2000)
    b = budget(probe, Clock(), refresh_interval_s=0)
    assert b.sees_host_memory and not budget(FixedProbe(1000), Clock()).sees_host_memory
    assert b.try_reserve(300) and b.available() == 450  # 1000 - 200 - 50 - 300
    probe.free_bytes -= 300  # the reserved cache is allocated: the probe shows it
    assert b.available() == 150  # counted twice until its owner says so
    b.set_visible(300)
    assert b.available() == 450 and b.visible == 300
    assert b.capacity() == 750  # everything back: what was free before
    with pytest.raises(ValueError, match="visible"):
        b.release(300)  # its visible part is taken back first
    with pytest.raises(ValueError, match="outside"):
        b.set_visible(1)  # never more than is reserved
    b.set_visible(-300)
    probe.free_bytes += 300
    b.release(300)
    assert b.available() == b.capacity() == 750 and b.visible == 0
    # budget_mb's cap is no probe reading: there every reservation counts whole
    capped = budget(HostProbe(1000, total_bytes=2000), Clock(), fixed_bytes=500, refresh_interval_s=0)
    capped.reserve(300)
    capped.set_visible(300)
    assert capped.available() == 200 and capped.capacity() == 500


def test_fixed_bytes_caps_the_budget() -> None:
    probe = FixedProbe(1000, total_bytes=2000)
    b = budget(probe, Clock(), fixed_bytes=300)
    assert b.available() == 300  # min(300, 750)
    b.reserve(100)
    assert b.available() == 200
    roomy = budget(probe, Clock(), fixed_bytes=10_000)
    assert roomy.available() == 750  # the device figure is lower


def test_never_negative_when_free_is_below_the_margins() -> None:
    b = budget(FixedProbe(100, total_bytes=2000), Clock())
    assert b.available() == 0  # 100 - 200 - 50 < 0


def test_default_margins() -> None:
    gib = 1 << 30
    b = MemoryBudget(FixedProbe(4 * gib, total_bytes=8 * gib), clock=Clock())
    # 4 GiB - 0.1 x 8 GiB (858993459) - 256 MiB
    assert b.available() == 4 * gib - 858993459 - 256 * (1 << 20)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"reserve_fraction": 1.0}, "reserve_fraction"),
        ({"reserve_fraction": -0.1}, "reserve_fraction"),
        ({"reserve_fraction": "0.1"}, "reserve_fraction"),
        ({"headroom_bytes": -1}, "headroom_bytes"),
        ({"headroom_bytes": 1.5}, "headroom_bytes"),
        ({"fixed_bytes": 0}, "fixed_bytes"),
        ({"fixed_bytes": True}, "fixed_bytes"),
        ({"refresh_interval_s": -1}, "refresh_interval_s"),
        ({"refresh_interval_s": float("nan")}, "refresh_interval_s"),
        ({"clock": 5}, "clock"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        MemoryBudget(FixedProbe(1000), **kwargs)  # type: ignore[arg-type]


def test_probe_must_be_a_probe() -> None:
    with pytest.raises(ConfigError, match="probe"):
        MemoryBudget(object())  # type: ignore[arg-type]


def test_consumers_waiting_for_memory_take_it_in_the_order_they_began_to_wait() -> None:
    clock = Clock()
    b = budget(FixedProbe(1000, total_bytes=2000), clock)  # 750 available
    assert b.first_in_line("gen") and b.try_reserve(100, waiter="gen")  # nobody waits: granted
    b.wait_in_line("vision")  # an engine model whose batch does not fit now
    clock.now = 1.0
    # memory is there, but vision has waited longer: refused, and gen now waits behind it
    assert not b.try_reserve(100, waiter="gen")
    assert b.first_in_line("vision") and not b.first_in_line("gen") and not b.first_in_line("other")
    b.wait_in_line("vision")  # renewing keeps the place
    clock.now = 2.0
    assert not b.try_reserve(100, waiter="gen")  # renewing gen's place keeps it behind
    b.leave_line("vision")  # it got its memory
    assert b.first_in_line("gen") and not b.first_in_line("other")  # gen waits, other does not
    assert b.try_reserve(100, waiter="gen") and b.first_in_line("other")  # granted: it left the line
    assert b.reserved == 200
    # without a waiter's name, try_reserve is the plain check
    b.wait_in_line("vision")
    assert b.try_reserve(100) and b.reserved == 300
    # memory short (450 available, 750 once the reservations are back): refused, and the waiter
    # takes its place behind those already waiting
    clock.now = 3.0
    assert not b.try_reserve(500, waiter="gen") and b.first_in_line("vision") and not b.first_in_line("gen")
    b.leave_line("vision")
    clock.now = 4.0
    assert not b.try_reserve(500, waiter="gen")  # renewed: still since 3.0
    b.wait_in_line("vision")
    assert not b.first_in_line("vision") and b.first_in_line("gen")
    b.leave_line("gen")
    b.leave_line("nobody")  # leaving a line one is not in is allowed


def test_a_place_in_the_line_not_renewed_for_the_lease_is_gone() -> None:
    clock = Clock()
    b = budget(FixedProbe(1000, total_bytes=2000), clock)
    b.wait_in_line("unloaded")  # a model that stopped renewing (unloaded while it waited)
    assert not b.try_reserve(100, waiter="gen")
    clock.now = WAIT_LEASE_S + 0.1
    b.wait_in_line("gen")
    assert b.first_in_line("gen") and b.try_reserve(100, waiter="gen")
    # renewed after it lapsed, a place starts again at the back
    b.wait_in_line("gen")
    clock.now += 1.0
    b.wait_in_line("unloaded")
    assert not b.first_in_line("unloaded") and b.first_in_line("gen")


def test_an_engine_batch_gives_way_only_to_a_consumer_that_has_waited_a_while() -> None:
    clock = Clock()
    b = budget(FixedProbe(1000, total_bytes=2000), clock)  # 750 available
    assert b.may_take("vibration")  # nobody waits
    b.reserve(200)  # an engine batch in flight
    assert not b.try_reserve(600, waiter="gen")  # would fit once it came back
    clock.now = PRIORITY_AFTER_S / 2
    assert b.may_take("vibration")  # a short wait holds no engine batch back
    clock.now = PRIORITY_AFTER_S
    assert not b.may_take("vibration") and b.may_take("gen")
    b.wait_in_line("vibration")  # waiting now too, behind gen
    assert not b.may_take("vibration")
    b.leave_line("gen")
    assert b.may_take("vibration")


def test_a_generator_waiting_for_memory_it_holds_itself_stands_in_nobody_s_way() -> None:
    clock = Clock()
    b = budget(FixedProbe(10_000, total_bytes=20_000), clock, fixed_bytes=750)  # the cap decides
    assert b.try_reserve(500, waiter="gen")
    b.reserve(200)  # an engine batch in flight
    # 300 more never fit beside its own 500, even with the engine's 200 back: gen waits for its
    # own sequences to finish and takes no place in the line
    assert not b.try_reserve(300, waiter="gen", keeps=500)
    clock.now = 2 * PRIORITY_AFTER_S
    assert b.may_take("vibration") and b.first_in_line("other")
    # 200 more fits once the engine batch is back: then it does wait in the line
    assert not b.try_reserve(200, waiter="gen", keeps=500)
    clock.now = 3 * PRIORITY_AFTER_S
    assert not b.may_take("vibration")
    b.release(200)
    assert b.try_reserve(200, waiter="gen", keeps=500) and b.may_take("vibration")


def test_a_release_is_announced_to_those_in_the_line_only() -> None:
    b = budget(FixedProbe(1000, total_bytes=2000), Clock())
    woken: list[str] = []
    b.on_memory_back("vision", lambda: woken.append("vision"))
    b.on_memory_back("gen", lambda: woken.append("gen"))
    b.reserve(300)
    b.release(100)
    assert woken == []  # nobody waits: nothing to announce
    b.wait_in_line("vision")
    b.release(100)
    assert woken == ["vision"]  # gen has a waker but does not wait
    def reloaded() -> None:
        woken.append("vision again")

    b.on_memory_back("vision", reloaded)  # the model loaded again before the old one closed
    b.forget_waker("vision", woken.clear)  # not the one registered now: kept
    b.release(50)
    assert woken == ["vision", "vision again"]
    b.forget_waker("vision", reloaded)
    b.release(50)
    assert woken == ["vision", "vision again"]  # unregistered (the model was unloaded)


def test_the_line_report_counts_waits_and_the_seconds_waited() -> None:
    clock = Clock()
    b = budget(FixedProbe(1000, total_bytes=2000), clock)
    assert b.line_report() == {}  # nobody ever waited
    b.wait_in_line("vision")
    clock.now = 0.5
    b.wait_in_line("vision")  # renewed: the same wait
    assert b.line_report() == {"vision": (True, 1, 0.5)}
    clock.now = 1.0
    b.leave_line("vision")
    assert b.line_report() == {"vision": (False, 1, 1.0)}
    clock.now = 2.0
    b.wait_in_line("vision")
    clock.now = 2.25
    b.wait_in_line("vision")
    clock.now = 2.25 + WAIT_LEASE_S + 1  # it stopped renewing: the wait ended at its last renewal
    assert b.line_report() == {"vision": (False, 2, 1.25)}
    b.wait_in_line("vision")  # a new wait
    assert b.line_report()["vision"][:2] == (True, 3)
    assert not b.try_reserve(10_000, waiter="gen")  # more than could ever fit: never in the line
    assert "gen" not in b.line_report()


def test_leaving_the_line_wakes_those_still_in_it() -> None:
    """Whoever was behind may be first now: a consumer held back only by the line's order need
    not wait for its next look to find out."""
    b = budget(FixedProbe(1000, total_bytes=2000), Clock())  # 750 available
    woken: list[str] = []
    b.on_memory_back("gen", lambda: woken.append("gen"))
    b.wait_in_line("vision")
    assert not b.try_reserve(100, waiter="gen")  # it fits, but vision has waited longer
    assert woken == []
    assert b.try_reserve(200, waiter="vision")  # vision gets its memory and leaves the line
    assert woken == ["gen"] and b.try_reserve(100, waiter="gen")
    b.wait_in_line("vision")
    b.wait_in_line("gen")
    b.leave_line("vision")  # nothing left to run
    assert woken == ["gen", "gen"]


def test_a_model_s_old_and_new_versions_keep_their_own_places_in_the_line() -> None:
    """While a model is reloaded its old version drains as the new one serves: both consume, and
    the old one leaving the line (its last batch ran) must not take the new one's place. The
    metrics count the model's waits across both."""
    clock = Clock()
    b = budget(FixedProbe(1000, total_bytes=2000), clock)
    old, new, gen = b.consumer("vision"), b.consumer("vision"), b.consumer("gen")
    assert len({old, new, gen}) == 3
    b.wait_in_line(new)
    clock.now = 0.5
    b.wait_in_line(old)
    clock.now = 0.6
    b.leave_line(old)  # the old version is done: it waited 0.1 s
    assert b.first_in_line(new) and not b.try_reserve(100, waiter=gen)  # the new one is still ahead
    assert b.line_report()["vision"] == (True, 2, pytest.approx(0.1))
    b.leave_line(new)  # 0.6 s
    assert b.try_reserve(100, waiter=gen)
    assert b.line_report()["vision"] == (False, 2, pytest.approx(0.7))
