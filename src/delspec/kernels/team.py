"""How many threads the compiled kernels use, chosen by what their calls measure.

torch's thread count (`torch.get_num_threads()`) is the team size while the team's threads run
together. When other processes hold the cores, a thread can lose its core while its partners
wait for it at a barrier; the layer calls report such waits (a wait that outlasted the waiting
thread's own share of the work went to sleep, `layers.c`). While calls keep reporting them (or
one call's waits mostly slept: its threads hardly ran together), each call shape (rows, layer
range; a product's weight and rows) runs with whichever of the full team and one thread has
been faster lately for it (decayed means of measured seconds, a faster call taken at once),
trying the other one call in `EXPLORE`, or in twice as many each time a trial does not change
the choice (up to `MAX_EXPLORE`). A trial of the full team for layers while one thread is
faster waits until the cores look free (`free_cores`: what the other processes leave of them,
read from the kernel's count of runnable threads where it has one): under another process's
load such a trial costs several calls (each barrier a lost time slice, several times a call's
time on one thread). A product (the head) has no barrier, only the join at its end, so its
trials need no free cores: under a busy loop per core its full team holds more of the runnable
threads than one thread does. No waits, no trials: on a quiet machine the team is always the
full one.
"""

from __future__ import annotations

import os
from collections import deque

import torch

EXPLORE = 8  # while contended, one call in this many per shape runs the other team size...
MAX_EXPLORE = 64  # ...or in up to this many, while trials keep confirming the choice
WINDOW = 8  # team calls over which sleeping waits are counted
DECAY = 0.5  # weight of the newest time in a shape's decayed mean


def free_cores() -> int | None:
    """Cores that threads of other processes do not hold now: the CPUs less the runnable
    threads the kernel counts (`/proc/loadavg`) that are not this process's own; None where
    that count cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended meanwhile
                continue
            own += stat[stat.rfind(")") + 2] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) - max(runnable - own, 0)


class Team:
    """The team size for the next compiled call; see the module docstring."""

    def __init__(self) -> None:
        self.recent: deque[bool] = deque(maxlen=WINDOW)  # team calls: whether any wait slept
        self.scattered = False  # whether the last team call's waits mostly slept
        self.seconds: dict[tuple, dict[int, float]] = {}  # shape -> team size -> decayed mean
        self.calls: dict[tuple, int] = {}
        self.trials: dict[tuple, tuple[int, int, int]] = {}  # shape -> next trial, interval, best
        self.solo = False  # whether the last layer call chose one thread

    def contended(self) -> bool:
        """Whether at least half of the recent team calls had a wait that slept, or the last
        one's waits mostly did."""
        return self.scattered or sum(self.recent) * 2 >= WINDOW

    def threads(self, shape: tuple, barriers: bool = True) -> int:
        """Threads for a compiled call of `shape`: a layer call, or a product (no `barriers`)."""
        full = torch.get_num_threads()
        if full <= 1 or not self.contended():
            self.solo = False
            return full
        times = self.seconds.get(shape, {})
        count = self.calls[shape] = self.calls.get(shape, 0) + 1
        if full not in times and 1 not in times:
            choice = 1 if self.scattered else full
        elif 1 not in times:
            choice = 1
        elif full not in times:  # contended from the start (one call's waits mostly slept)
            free = not barriers or self._free_for(full)
            choice = full if count % EXPLORE == 0 and free else 1
        else:
            best = min(times, key=times.__getitem__)
            at, interval, before = self.trials.get(shape, (count + EXPLORE, EXPLORE, best))
            if best != before:
                at, interval = min(at, count + EXPLORE), EXPLORE
            choice = best
            if count >= at and best != full and barriers and not self._free_for(full):
                at = count + EXPLORE  # the cores are still busy: look again later
            elif count >= at:  # a trial of the other size
                choice = 1 if best == full else full
                interval = min(2 * interval, MAX_EXPLORE)
                at = count + interval
            self.trials[shape] = (at, interval, best)
        if barriers:
            self.solo = choice == 1
        return choice

    @staticmethod
    def _free_for(threads: int) -> bool:
        """Whether the cores look free enough for a team of `threads` with barriers (True
        where it cannot be told; a call without barriers needs no free core)."""
        free = free_cores()
        return free is None or free >= threads

    def other_threads(self) -> int:
        """Threads for compiled calls not timed on their own (dequantising rows): one while the
        layers run on one."""
        return 1 if self.solo else torch.get_num_threads()

    def report(self, shape: tuple, threads: int, seconds: float, waits: int, slept: int) -> None:
        """What a compiled call of `shape` with `threads` measured: its seconds, and of its
        barrier waits (none for a product), how many slept."""
        if threads > 1 and waits:
            self.recent.append(slept > 0)
            self.scattered = slept * 2 > waits
        if not self.contended():
            self.seconds.clear()
            self.calls.clear()
            self.trials.clear()
            return
        times = self.seconds.setdefault(shape, {})
        old = times.get(threads)
        # quick to credit a faster call (a trial that finds the cores free again), slower to
        # forget a fast past
        times[threads] = (
            seconds if old is None else min(seconds, (1 - DECAY) * old + DECAY * seconds)
        )


TEAM = Team()
