"""The memory watch while serving: the memory in use against the plan, and what follows when it grew.

memory/plan.py holds the plan per meter and finds the overruns; this module ties them to the
models: which ones ran since the last look (engine models and generators), each overrun counted
in the budget as resident memory (it is held now, whatever holds it), and, while that leaves the
budget overdrawn, the batch sizes of the engine models that ran shrink by one step per look, down
to the smallest: their largest batches are the ones that could grow further; once the budget is
no longer overdrawn they grow back one step per look. Growth of the process's own memory that
the meter no longer shows later is given back to the budget. While a model is loaded or
unloaded (`changing`) the watch does not look: the loading version's memory is in no model's
resident figure until it is measured, and a version taken out of service holds its memory until
it has drained; what such changes leave behind is counted at the next look, named after them
(docs/memory.md, "The plan under traffic"). The daemon calls `settle` just before ready and
`check` every `[memory] check_interval_s`; both read the meters only (cheap enough for the event
loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .memory.budget import MemoryBudget
from .memory.plan import MemoryPlan
from .scheduler.runner import ModelRunner
from .servable import Servable

log = logging.getLogger(__name__)

MiB = 1 << 20


class MemoryWatch:
    def __init__(self, budget: MemoryBudget, servables: Callable[[], list[Servable]]):
        self.budget = budget
        self.plan = MemoryPlan(budget.probe)
        self._servables = servables  # the loaded models
        self._batches_seen: dict[str, int] = {}  # batches started per model at the last look
        self.unplanned = 0  # overruns counted into budget.resident since the start
        self._changing = 0  # model loads and unloads in progress
        self._changes: list[str] = []  # those finished since the last look

    @contextmanager
    def changing(self, what: str) -> Iterator[None]:
        """Around a change of the loaded models ("loading model x", "unloading model y"): no look
        meanwhile; what the change left beyond the models' measured memory is counted at the next
        look after it, named after the change rather than after the models that ran."""
        self._changing += 1
        try:
            yield
        finally:
            self._changing -= 1
            self._changes.append(what)

    def start(self) -> None:
        """Before any model loads."""
        self.plan.start()

    def _runners(self) -> list[ModelRunner]:
        return [s for s in self._servables() if isinstance(s, ModelRunner)]

    def residents(self) -> dict[str, int]:
        """The resident memory of the loaded models (generators too), by the meter that measured it."""
        by_meter: dict[str, int] = {}
        for servable in self._servables():
            meter = servable.resident_meter
            if meter is not None:
                by_meter[meter] = by_meter.get(meter, 0) + servable.resident_bytes
        return by_meter

    def planned(self) -> dict[str, int]:
        return self.plan.planned(self.residents(), self.budget.reserved)

    def settle(self) -> None:
        """Count what the daemon holds at ready beyond its models. Just before ready."""
        self.plan.settle(self.residents())
        self._batches_seen = {s.name: s.batches_started for s in self._servables()}

    def check(self) -> None:
        """Compare the memory in use with the plan; growth beyond it is logged at WARNING, naming
        the models that ran since the last look (at INFO, naming the model changes, after a load
        or an unload), and counted; an overdrawn budget shrinks them."""
        if self._changing:
            return  # the loaded models and their memory are changing: look once they have
        changes, self._changes = self._changes, []
        residents = self.residents()
        # The process's own memory always (request bodies and Python objects use the headroom);
        # a device's, where other processes allocate too, only once it holds measured models.
        tolerance = {meter: resident // 20 for meter, resident in residents.items()}
        tolerance["process"] = self.budget.headroom_bytes
        overruns = self.plan.check(residents, self.budget.reserved, tolerance)
        ran = []
        for servable in self._servables():
            if servable.batches_started != self._batches_seen.get(servable.name, 0):
                ran.append(servable)
            self._batches_seen[servable.name] = servable.batches_started
        ran_names = ", ".join(_what_ran(s) for s in ran) or "none"
        for overrun in overruns:
            where = "" if overrun.meter == "process" else " (by this daemon or another process on the device)"
            figures = (overrun.meter, overrun.used / MiB, overrun.excess / MiB, overrun.planned / MiB)
            if changes:
                # Expected: an allocator keeps much of what an unloaded version freed (glibc's heap),
                # and a reload's new version reuses it; held all the same, so counted.
                log.info("memory: %s in use is %.1f MiB, %.1f MiB above the plan (%.1f MiB) after %s: what the "
                         "change left beyond the models' measured memory%s, now counted in the plan; models that "
                         "ran since the last check: %s", *figures, "; ".join(dict.fromkeys(changes)), where, ran_names)
            else:
                log.warning("memory: %s in use is %.1f MiB, %.1f MiB above the plan (%.1f MiB): growth that no "
                            "measurement at load saw%s, now counted in the plan; models that ran since the last check: "
                            "%s", *figures, where, ran_names)
            self.budget.resident += overrun.excess
            self.unplanned += overrun.excess
        if not overruns and self.unplanned:
            # The process's own meter only: it reads this process alone (plan.given_back). Against
            # the plan without the reservations: memory promised and not yet allocated (a
            # generator's batch just admitted) would look like growth gone that is still held.
            for back in self.plan.given_back(residents, 0, {"process"}):
                log.info("memory: %s in use is %.1f MiB, %.1f MiB below the plan: %.1f MiB of the growth counted "
                         "since ready has gone and is given back to the budget", back.meter, back.used / MiB,
                         (back.planned - back.used) / MiB, back.amount / MiB)
                self.budget.resident -= back.amount
                self.unplanned -= back.amount
        shrunk = [runner for runner in self._runners() if runner.shrunk_from is not None]
        if not self.unplanned and not shrunk:
            return
        self.budget.refresh()
        if self.budget.overdrawn():
            if not self.unplanned:
                return  # held by others (a host probe's free memory): not what serving here grew
            for runner in ran:
                if not isinstance(runner, ModelRunner):
                    continue  # a generator's admission already holds its cache to the budget
                smaller = runner.shrink_batch_size()
                if smaller is not None:
                    log.warning("model %s: the memory budget is overdrawn by growth no measurement saw (%.1f MiB "
                                "counted): serving batch sizes up to %d", runner.name, self.unplanned / MiB, smaller)
            return
        # Room again (growth given back, or others freed memory): one size back per look, so a
        # size whose batches grow again is seen before the next; admission still checks each batch.
        for runner in shrunk:
            larger = runner.regrow_batch_size()
            log.info("model %s: the memory budget is no longer overdrawn (%.1f MiB available): serving batch "
                     "sizes up to %d%s", runner.name, self.budget.available() / MiB, larger,
                     "" if runner.shrunk_from is None else f" (up to {runner.shrunk_from} before the shrink)")


def _what_ran(servable: Servable) -> str:
    if isinstance(servable, ModelRunner):
        return f"{servable.name} (sizes up to {servable.settings.max_batch_size})"
    return servable.name
