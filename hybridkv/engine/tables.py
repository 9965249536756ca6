"""Page tables, one row per running sequence, kept from step to step and
updated only where the manager changed them. Two halves:

* `TableRows`, the driver's (beside the manager): which row each sequence
  holds, and a host copy of every row; a step's `changes()` are the
  entries that differ from what the workers hold, and go with its plan;
* `DeviceTables`, each worker's (beside its pool): the tables on the
  device, which `apply(changes)` updates.

Per group:
* attention group g: `attention[g]` `[width, rows + 1, max_blocks]`, page
  ids of each block from key position 0 (one plane per page column of a
  multi-page block);
* Mamba group g: `read[g]`, `write[g]` `[rows + 1, width]` (the pages of
  the block holding the state, and of the block the next state goes to) and
  `zero[g]` `[rows + 1]` (no state yet: start from zeros).

The last row is the padding row of fixed-shape decode steps: it writes to
the KV buffers' sink pages, where no real table reads (and reads the zero
state from the null page). Only the workers' tables have it.

A sequence's row is refreshed when the manager's `table_version` of its
sequence changed: the new table is compared with the host copy of the row
and only the entries that differ are sent (`pages_written` counts them: a
decode step at 8K tokens sends what one at 1K sends).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import KVCacheManager
from ..core.layout import KVCacheLayout


def max_blocks(layout: KVCacheLayout, max_model_len: int) -> int:
    return -(-max_model_len // layout.block_size) + 1


def host_tables(layout: KVCacheLayout, rows: int, width: int) -> tuple[dict, dict, dict, dict]:
    """Empty tables of `rows` rows on the host, per group: attention
    [pages per block, rows, width]; recurrent read and write [rows, pages
    per block] and zero [rows] (no state yet)."""
    attention, read, write, zero = {}, {}, {}, {}
    for g in layout.groups:
        if g.recurrent:
            read[g.index] = np.zeros((rows, g.pages_per_block), dtype=np.int64)
            write[g.index] = np.zeros((rows, g.pages_per_block), dtype=np.int64)
            zero[g.index] = np.ones(rows, dtype=np.bool_)
        else:
            attention[g.index] = np.zeros((g.pages_per_block, rows, width), dtype=np.int64)
    return attention, read, write, zero


class TableRows:
    """The driver's half: rows, host copies, and the changes to send."""

    def __init__(self, layout: KVCacheLayout, kv: KVCacheManager, max_rows: int, max_model_len: int):
        self.layout = layout
        self.kv = kv
        self.max_blocks = max_blocks(layout, max_model_len)
        self._host, self._host_read, self._host_write, self._host_zero = host_tables(layout, max_rows,
                                                                                      self.max_blocks)
        self._pending: dict[int, list] = {}  # group -> rows (recurrent) or (row, columns) not yet sent
        self._row: dict[str, int] = {}
        self._version = [0] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        self.pages_written = 0  # table entries sent, ever

    def row(self, seq_id: str) -> int:
        """The sequence's row, assigned on first use and refreshed if its
        tables changed since the last step (`changes` hands them over)."""
        row = self._row.get(seq_id)
        if row is None:
            if not self._free:
                raise RuntimeError("more running sequences than table rows (max_num_seqs)")
            row = self._row[seq_id] = self._free.pop()
            self._version[row] = 0
        version = self.kv.table_version(seq_id)
        if version != self._version[row]:
            self._refresh(row, seq_id)
            self._version[row] = version
        return row

    def release(self, seq_id: str) -> None:
        """The sequence left the running set (finished, preempted, aborted)."""
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def _refresh(self, row: int, seq_id: str) -> None:
        kv = self.kv
        tables = kv.get_page_tables(seq_id)
        states = None
        for g in self.layout.groups:
            width = g.pages_per_block
            if g.recurrent:
                if states is None:
                    states = kv.get_state_pages(seq_id)
                read, write = states[g.index]
                new_read = read or (0,) * width
                new_write = write or new_read
                reads, writes, zeros = self._host_read[g.index], self._host_write[g.index], self._host_zero[g.index]
                if (tuple(reads[row]) != tuple(new_read) or tuple(writes[row]) != tuple(new_write)
                        or zeros[row] != (read is None) or self._version[row] == 0):
                    reads[row], writes[row], zeros[row] = new_read, new_write, read is None
                    self._pending.setdefault(g.index, []).append(row)
                    self.pages_written += 2 * width
                continue
            host = self._host[g.index]
            pages = np.asarray(tables[g.index], dtype=np.int64).reshape(-1, width).T  # [width, blocks]
            n = pages.shape[1]
            if n > self.max_blocks:
                raise RuntimeError(f"sequence {seq_id} holds {n} blocks, the tables have {self.max_blocks}")
            # Entries past the table's end stay as they were: no query reads past its own position.
            diff = np.nonzero((host[:, row, :n] != pages).any(axis=0))[0]
            if diff.size:
                host[:, row, diff] = pages[:, diff]
                self._pending.setdefault(g.index, []).append((row, diff))
                self.pages_written += diff.size * width

    def changes(self) -> list:
        """The entries refreshed since the last call, with their values, for
        the workers' tables (`DeviceTables.apply`), one entry per group
        that changed: an attention group's (g, rows [m], columns [m], pages
        [width, m]); a Mamba group's (g, rows [m], read [m, width], write
        [m, width], zero [m])."""
        out = []
        for g, pending in self._pending.items():
            if g in self._host:
                rows = np.concatenate([np.full(len(cols), row, dtype=np.int64) for row, cols in pending])
                cols = np.concatenate([cols for _, cols in pending])
                out.append((g, rows, cols, self._host[g][:, rows, cols]))
            else:
                rows = np.asarray(pending, dtype=np.int64)
                out.append((g, rows, self._host_read[g][rows], self._host_write[g][rows], self._host_zero[g][rows]))
        self._pending.clear()
        return out


class DeviceTables:
    """A worker's half: the tables on its device, and the padding row."""

    def __init__(self, layout: KVCacheLayout, max_rows: int, max_model_len: int, device: torch.device,
                 sink_page):
        self.device = torch.device(device)
        self.pad_row = max_rows
        # Host copies in the device tensors' layout. On the CPU they are the
        # same memory (an update writes once); on a GPU the changed entries are
        # copied over in one batch per group.
        self._host, self._host_read, self._host_write, self._host_zero = host_tables(
            layout, max_rows + 1, max_blocks(layout, max_model_len))
        for g in layout.groups:  # the padding row: sink pages
            sinks = [sink_page(c) for c in range(g.pages_per_block)]
            if g.recurrent:
                self._host_write[g.index][self.pad_row] = sinks  # padding reads the zero state (the null page)
            else:
                self._host[g.index][:, self.pad_row] = np.asarray(sinks)[:, None]
        self.attention = {g: self._device(a) for g, a in self._host.items()}
        self.read = {g: self._device(a) for g, a in self._host_read.items()}
        self.write = {g: self._device(a) for g, a in self._host_write.items()}
        self.zero = {g: self._device(a) for g, a in self._host_zero.items()}

    def _device(self, host: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(host)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def apply(self, changes: list) -> None:
        """Write the driver's `TableRows.changes()`: one write per group and
        table (on the CPU the device tensors are the host arrays)."""
        on_host = self.device.type == "cpu"
        for change in changes:
            g, rows = change[0], change[1]
            if g in self._host:
                cols, pages = change[2], change[3]
                self._host[g][:, rows, cols] = pages
                if not on_host:
                    self.attention[g][:, torch.from_numpy(rows).to(self.device),
                                      torch.from_numpy(cols).to(self.device)] = torch.from_numpy(pages).to(self.device)
                continue
            self._host_read[g][rows], self._host_write[g][rows], self._host_zero[g][rows] = change[2:]
            if not on_host:
                index = torch.from_numpy(rows).to(self.device)
                self.read[g][index] = torch.from_numpy(self._host_read[g][rows]).to(self.device)
                self.write[g][index] = torch.from_numpy(self._host_write[g][rows]).to(self.device)
                self.zero[g][index] = torch.from_numpy(self._host_zero[g][rows]).to(self.device)
