"""How many threads the compiled kernels use, chosen by what their calls measure.

torch's thread count (`torch.get_num_threads()`) is the team size while the team's threads run
together. When other processes hold the cores, a thread can lose its core while its partners
wait for it at a barrier; the layer calls report such waits (a wait that outlasted the waiting
thread's own share of the work went to sleep, `layers.c`). While calls keep reporting them, each
call shape (rows, layer range) runs with whichever of the full team and one thread has been
faster lately for it (decayed means of measured seconds), trying the other one call in
`EXPLORE`. No waits, no trials: on a quiet machine the team is always the full one.
"""

from __future__ import annotations

from collections import deque

import torch

EXPLORE = 8  # while contended, one call in this many per shape runs the other team size
WINDOW = 8  # calls over which sleeping waits are counted
DECAY = 0.3  # weight of the newest time in a shape's decayed mean


class Team:
    """The team size for the next compiled call; see the module docstring."""

    def __init__(self) -> None:
        self.recent: deque[bool] = deque(maxlen=WINDOW)  # team calls: whether any wait slept
        self.seconds: dict[tuple, dict[int, float]] = {}  # shape -> team size -> decayed mean
        self.calls: dict[tuple, int] = {}
        self.solo = False  # whether the last layer call chose one thread

    def contended(self) -> bool:
        """Whether at least half of the recent team calls had a wait that slept."""
        return sum(self.recent) * 2 >= WINDOW

    def threads(self, shape: tuple) -> int:
        """Threads for a layer call of `shape`."""
        full = torch.get_num_threads()
        if full <= 1 or not self.contended():
            self.solo = False
            return full
        times = self.seconds.get(shape, {})
        count = self.calls[shape] = self.calls.get(shape, 0) + 1
        if full not in times:
            choice = full
        elif 1 not in times:
            choice = 1
        else:
            best = min(times, key=times.__getitem__)
            choice = (1 if best == full else full) if count % EXPLORE == 0 else best
        self.solo = choice == 1
        return choice

    def other_threads(self) -> int:
        """Threads for the other compiled calls (products such as the head): one while the
        layers run on one."""
        return 1 if self.solo else torch.get_num_threads()

    def report(self, shape: tuple, threads: int, seconds: float, waits: int, slept: int) -> None:
        """What a layer call of `shape` with `threads` measured: its seconds, and of its
        barrier waits, how many slept."""
        if threads > 1 and waits:
            self.recent.append(slept > 0)
        if not self.contended():
            self.seconds.clear()
            self.calls.clear()
            return
        times = self.seconds.setdefault(shape, {})
        old = times.get(threads)
        times[threads] = seconds if old is None else (1 - DECAY) * old + DECAY * seconds


TEAM = Team()
