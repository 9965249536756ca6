"""The disk tier's storage alone (tiers/disk.py, no engine):
a shared directory, a block larger than the budget, a full disk and other
write errors. tests/test_faults.py drives the same faults through engines
in several processes."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import threading
import time
import warnings

import pytest
import torch

from disk_faults import BrokenDisk, SlowDisk, SmallDisk, dead_pid, used_bytes
from hybridkv.tiers.disk import DiskTier, _machine_id

PAGE = 4096
IDENTITY = bytes(range(32))


def block(i: int, width: int = 1) -> torch.Tensor:
    return torch.full((width, PAGE), i % 251, dtype=torch.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def tier(directory, budget=1 << 30, **kw) -> DiskTier:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return DiskTier(str(directory), IDENTITY, PAGE, budget, **kw)


def temporary_files(directory) -> list[str]:
    return glob.glob(os.path.join(str(directory), "*", "g*", "*.tmp"))


def plant_temporary(t: DiskTier, name: str, age: float = 0.0) -> str:
    path = os.path.join(t.root, "g0", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"half a block")
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


# -- a shared directory ---------------------------------------------------------------
def test_a_start_up_scan_keeps_what_a_live_writer_may_rename(tmp_path):
    first = tier(tmp_path)
    me, other = _machine_id(), "0123456789ab"
    live = plant_temporary(first, f"{key(1).hex()}.kv.{me}-{os.getpid()}-00ff00ff.tmp")
    elsewhere = plant_temporary(first, f"{key(2).hex()}.kv.{other}-{os.getpid()}-00ff00ff.tmp")
    dead = plant_temporary(first, f"{key(3).hex()}.kv.{me}-{dead_pid()}-00ff00ff.tmp")
    stale = plant_temporary(first, f"{key(4).hex()}.kv.{other}-1-00ff00ff.tmp", age=2 * DiskTier.STALE_TEMP_SECONDS)
    second = tier(tmp_path)
    assert os.path.exists(live), "a live writer's temporary file was removed"
    assert os.path.exists(elsewhere), "another machine's recent temporary file was removed"
    assert not os.path.exists(dead) and not os.path.exists(stale)
    assert second.swept_temps == 2


@contextlib.contextmanager
def held_before_its_rename(writer: DiskTier, i: int):
    """A write of block i, held between its temporary file and its rename
    until the block ends."""
    gate = threading.Event()
    slow = SlowDisk(writer, gate=gate)
    thread = threading.Thread(target=writer.write, args=(0, key(i), block(i)))
    thread.start()
    assert slow.entered.wait(10)
    try:
        yield
    finally:
        gate.set()
        thread.join()


def test_a_write_in_flight_survives_another_tiers_start(tmp_path):
    # The writer holds its temporary file while a second tier starts over the
    # same directory: the rename still lands and the writer keeps writing.
    writer = tier(tmp_path)
    with held_before_its_rename(writer, 1):
        assert len(temporary_files(tmp_path)) == 1
        tier(tmp_path)  # another engine starts here now
    assert (0, key(1)) in writer.files and writer.writable and writer.write_errors == 0
    writer.write(0, key(2), block(2))
    assert len(writer.files) == 2 and not temporary_files(tmp_path)
    assert torch.equal(tier(tmp_path).read(0, key(1)), block(1))


def test_a_temporary_file_removed_under_the_writer_loses_that_block_only(tmp_path):
    writer = tier(tmp_path)
    with held_before_its_rename(writer, 1):
        for path in temporary_files(tmp_path):
            os.unlink(path)  # an older version's scan, or an operator
    assert (0, key(1)) not in writer.files and writer.writable and writer.write_errors == 1
    writer.write(0, key(2), block(2))
    assert (0, key(2)) in writer.files


# -- the budget -----------------------------------------------------------------------
def test_a_block_larger_than_the_budget_is_refused_before_anything_is_removed(tmp_path):
    t = tier(tmp_path, budget=3 * (PAGE + 200))
    for i in range(3):
        assert t.write(0, key(i), block(i)) == []
    assert len(t.files) == 3
    assert t.write(0, key(9), block(9, width=4)) == []
    assert len(t.files) == 3 and (0, key(9)) not in t.files
    removed = t.write(0, key(3), block(3))  # one more of the usual size pushes out the oldest
    assert removed == [(0, key(0))] and len(t.files) == 3


# -- write errors ---------------------------------------------------------------------
def test_a_full_disk_makes_room_from_the_tiers_own_oldest_blocks(tmp_path):
    t = tier(tmp_path)  # a budget far above what the disk has
    size = PAGE + 200
    disk = SmallDisk(t, str(tmp_path), capacity=4 * size)
    removed = []
    for i in range(10):
        removed += t.write(0, key(i), block(i))
    assert disk.refused > 0 and t.writable
    assert len(t.files) == 4 and removed == [(0, key(i)) for i in range(6)]
    assert [k for _, k in t.files] == [key(i) for i in range(6, 10)]
    assert used_bytes(str(tmp_path)) == t.bytes


def test_a_full_disk_with_nothing_of_ours_pauses_and_resumes_once_space_is_freed(tmp_path):
    t = tier(tmp_path, retry_seconds=0.2)
    filler = tmp_path / "someone-elses-file"
    filler.write_bytes(bytes(10 * PAGE))
    SmallDisk(t, str(tmp_path), capacity=10 * PAGE + 100)
    with pytest.warns(RuntimeWarning, match="stops storing"):
        t.write(0, key(1), block(1))
    assert not t.writable and t.write_errors == 1 and "ENOSPC" in t.last_error
    assert t.write(0, key(2), block(2)) == [] and t.write_errors == 1  # paused: not even tried
    filler.unlink()  # the operator frees space
    time.sleep(0.25)
    assert t.writable
    t.write(0, key(3), block(3))
    assert (0, key(3)) in t.files and t.describe()["writable"]


def test_after_other_errors_writing_resumes_after_a_pause_that_doubles(tmp_path):
    t = tier(tmp_path, retry_seconds=0.1)
    disk = BrokenDisk(t, errno.EROFS)  # a read-only remount
    with pytest.warns(RuntimeWarning, match=r"for 0.1 s"):
        t.write(0, key(1), block(1))
    state = t.describe()
    assert state["writable"] is False and state["write_errors"] == 1 and 0 < state["retry_in_seconds"] <= 0.1
    time.sleep(0.12)
    with pytest.warns(RuntimeWarning, match=r"for 0.2 s"):  # still read-only: a longer pause
        t.write(0, key(2), block(2))
    disk.broken = False  # remounted read-write
    time.sleep(0.22)
    t.write(0, key(3), block(3))
    assert (0, key(3)) in t.files and t.writable and t.pause == 0.0 and t.write_errors == 2


def test_a_directory_that_cannot_be_made_is_retried(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the tier wants a directory")
    t = tier(blocker, retry_seconds=0.1)
    assert not t.writable
    blocker.unlink()
    time.sleep(0.12)
    t.write(0, key(1), block(1))
    assert (0, key(1)) in t.files and t.writable
