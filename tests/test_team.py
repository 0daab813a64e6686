"""The compiled kernels' team size: the full team unless its threads are seen not to run
together, then whichever of the full team and one thread measures faster."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from delspec.kernels import team as team_module
from delspec.kernels.team import EXPLORE, WINDOW, Team, free_cores

SHAPE = (1, 0, 30)


def run(team: Team, calls: int, seconds: dict[int, float], slept: int) -> list[int]:
    """`calls` layer calls that take `seconds[threads]` and report `slept` sleeping waits (of
    150)."""
    chosen = []
    for _ in range(calls):
        threads = team.threads(SHAPE)
        chosen.append(threads)
        team.report(SHAPE, threads, seconds[threads], 150 if threads > 1 else 0, slept)
    return chosen


def test_a_quiet_machine_always_runs_the_full_team(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    team = Team()
    assert run(team, 100, {1: 0.001, 2: 0.002}, slept=0) == [2] * 100  # no trials at all
    assert team.other_threads() == 2


def test_contention_runs_the_faster_size_and_keeps_trying_the_other(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(team_module, "free_cores", lambda: 2)  # trials find the cores free
    team = Team()
    chosen = run(team, 100, {1: 0.010, 2: 0.030}, slept=5)
    assert chosen[: WINDOW // 2] == [2] * (WINDOW // 2)  # contention is seen first
    late = chosen[50:]
    assert late.count(1) > len(late) * (EXPLORE - 2) / EXPLORE and 2 in late
    assert team.other_threads() in (1, 2)
    # the cores free again: the team's trials stop sleeping, and it returns for good
    after = run(team, 200, {1: 0.010, 2: 0.005}, slept=0)
    assert after[-50:] == [2] * 50


def test_contention_where_the_team_is_still_faster_keeps_it(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    team = Team()
    late = run(team, 100, {1: 0.030, 2: 0.010}, slept=3)[50:]
    assert late.count(2) >= len(late) * (EXPLORE - 2) / EXPLORE


def test_a_call_whose_waits_mostly_slept_goes_solo_at_once(monkeypatch):
    """One call in which most barrier waits slept is contention enough: the next call runs on
    one thread, and the full team is not tried again while other processes hold the cores."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    busy = [0]  # cores free of other processes' threads
    monkeypatch.setattr(team_module, "free_cores", lambda: busy[0])
    team = Team()
    chosen = run(team, 100, {1: 0.010, 2: 0.030}, slept=140)
    assert chosen[:2] == [2, 1] and chosen[1:] == [1] * 99  # no trial of the team: cores busy
    assert team.other_threads() == 1
    busy[0] = 2  # the other processes are gone: a trial, which no longer sleeps, and back
    assert run(team, 50, {1: 0.010, 2: 0.004}, slept=0)[-20:] == [2] * 20


def test_a_product_tries_the_full_team_on_busy_cores_and_keeps_it_where_faster(monkeypatch):
    """A product has no barrier: while the layers run on one thread and other processes hold
    every core, its trials of the full team still run, and a faster full team is kept."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(team_module, "free_cores", lambda: 0)
    team = Team()
    head = ("product", 49152, 576, 1)
    seconds = {1: 0.017, 2: 0.013}
    products = []
    for _ in range(100):
        run(team, 1, {1: 0.010, 2: 0.030}, slept=140)  # the layers: contended, one thread
        threads = team.threads(head, barriers=False)
        products.append(threads)
        team.report(head, threads, seconds[threads], 0, 0)
    assert team.other_threads() == 1  # the layers' choice, not the product's
    assert products[-50:].count(2) >= 50 * (EXPLORE - 2) / EXPLORE
    # where one thread is faster, the product keeps one and only tries the team now and then
    seconds[2] = 0.040
    late = []
    for _ in range(100):
        threads = team.threads(head, barriers=False)
        late.append(threads)
        team.report(head, threads, seconds[threads], 0, 0)
    assert late[-50:].count(1) >= 50 * (EXPLORE - 2) / EXPLORE and 2 in late[1:]


def test_free_cores_counts_what_other_processes_leave():
    free = free_cores()
    if free is None:
        pytest.skip("no /proc/loadavg here")
    assert free <= (os.cpu_count() or 1)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 5
        # until the busy loop runs (a sample is a snapshot: the one that saw it counts)
        while (seen := free_cores()) > (os.cpu_count() or 1) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen <= (os.cpu_count() or 1) - 1
    finally:
        hog.kill()
        hog.wait()
