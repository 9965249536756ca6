"""Processes below others, and ending them (Linux /proc; nothing elsewhere).

A server that started a local Ray must leave nothing behind when it stops,
yet some of Ray's processes ignore SIGTERM and outlive their parent (then
they hang under PID 1, where no tree leads to them): so the processes are
listed while the tree is whole, and ended after the shutdown.
"""

from __future__ import annotations

import os
import signal
import time


def processes_below(roots: list[int]) -> dict[int, str]:
    """The `roots` and every process below them (children, theirs, ...), by
    pid, with their start times (so a pid reused later is not taken for one
    of them)."""
    stats = _stats()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {}, [pid for pid in roots if pid in stats]
    while stack:
        pid = stack.pop()
        found[pid] = stats[pid][1]
        stack.extend(children.get(pid, []))
    return found


def end_processes(processes: dict[int, str], grace_s: float) -> None:
    """Wait up to `grace_s` seconds for `processes` (as processes_below
    lists them) to exit, then SIGKILL those still running, and wait (up to
    a second) until they are gone."""
    _wait(processes, grace_s)
    for pid in running(processes):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _wait(processes, 1.0)


def _wait(processes: dict[int, str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while running(processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def running(processes: dict[int, str]) -> list[int]:
    """Those of `processes` still running (not exited, not zombies)."""
    stats = _stats(processes)
    return [pid for pid, started in processes.items()
            if pid in stats and stats[pid][1] == started and stats[pid][2] != "Z"]


def _stats(pids=None) -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, state), from /proc/<pid>/stat."""
    stats = {}
    try:
        names = [str(p) for p in pids] if pids is not None else [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return stats
    for name in names:
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        stats[int(name)] = (int(fields[1]), fields[19], fields[0])
    return stats
