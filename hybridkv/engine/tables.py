"""Persistent block tables on the device: one row per running sequence
(a slot), kept from step to step and updated only where the manager changed
them.

* attention group g: `attention[g]` `[width, slots + 1, max_blocks]`, page
  ids of each block from key position 0 (one plane per page column of a
  multi-page block);
* Mamba group g: `read[g]`, `write[g]` `[slots + 1, width]` (the pages of
  the block holding the state, and of the block the next state goes to) and
  `zero[g]` `[slots + 1]` (no state yet: start from zeros).

The last row is the padding row of fixed-shape decode steps: its pages are
the KV buffers' sink pages, so padding writes where no real table reads.

A slot's row is refreshed when the manager's `table_version` of its
sequence changed: the new table is compared with a host copy of the row and
only the entries that differ are written to the device (`pages_written`
counts them: a decode step at 8K tokens writes what one at 1K writes).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import KVCacheManager
from ..core.layout import KVCacheLayout


class DeviceTables:
    def __init__(self, layout: KVCacheLayout, kv: KVCacheManager, max_slots: int, max_model_len: int,
                 device: torch.device, sink_page):
        self.layout = layout
        self.kv = kv
        self.device = device
        self.pad_row = max_slots
        rows = max_slots + 1
        self.max_blocks = -(-max_model_len // layout.block_size) + 1
        self.attention: dict[int, torch.Tensor] = {}
        self.read: dict[int, torch.Tensor] = {}
        self.write: dict[int, torch.Tensor] = {}
        self.zero: dict[int, torch.Tensor] = {}
        self._host: dict[int, np.ndarray] = {}  # attention: [rows, max_blocks, width]; mamba: [rows, 2, width]
        for g in layout.groups:
            width = g.pages_per_block
            sinks = [sink_page(c) for c in range(width)]
            if g.kind == "mamba":
                host = np.zeros((rows, 2, width), dtype=np.int64)
                host[self.pad_row] = sinks
                self.read[g.index] = torch.from_numpy(host[:, 0].copy()).to(device)
                self.write[g.index] = torch.from_numpy(host[:, 1].copy()).to(device)
                zero = torch.ones(rows, dtype=torch.bool)
                self.zero[g.index] = zero.to(device)
            else:
                host = np.zeros((rows, self.max_blocks, width), dtype=np.int64)
                host[self.pad_row] = sinks
                self.attention[g.index] = torch.from_numpy(np.ascontiguousarray(host.transpose(2, 0, 1))).to(device)
            self._host[g.index] = host
        self._slot: dict[str, int] = {}
        self._version = [0] * rows
        self._free = list(range(max_slots - 1, -1, -1))
        self.pages_written = 0  # table entries written to the device, ever

    def slot(self, seq_id: str) -> int:
        """The sequence's row, assigned on first use and refreshed if its
        tables changed since the last step."""
        row = self._slot.get(seq_id)
        if row is None:
            if not self._free:
                raise RuntimeError("more running sequences than table slots (max_num_seqs)")
            row = self._slot[seq_id] = self._free.pop()
            self._version[row] = 0
        version = self.kv.table_version(seq_id)
        if version != self._version[row]:
            self._refresh(row, seq_id)
            self._version[row] = version
        return row

    def release(self, seq_id: str) -> None:
        """The sequence left the running set (finished, preempted, aborted)."""
        row = self._slot.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def _refresh(self, row: int, seq_id: str) -> None:
        kv = self.kv
        tables = kv.get_block_tables(seq_id)
        states = None
        for g in self.layout.groups:
            host = self._host[g.index]
            width = g.pages_per_block
            if g.kind == "mamba":
                if states is None:
                    states = kv.get_state_blocks(seq_id)
                read, write = states[g.index]
                new = np.array([read or (0,) * width, write or read or (0,) * width], dtype=np.int64)
                changed = np.nonzero((host[row] != new).any(axis=1))[0]
                if changed.size or self._version[row] == 0:
                    host[row] = new
                    device_read, device_write = self.read[g.index], self.write[g.index]
                    device_read[row] = torch.from_numpy(new[0]).to(self.device)
                    device_write[row] = torch.from_numpy(new[1]).to(self.device)
                    self.zero[g.index][row] = read is None
                    self.pages_written += 2 * width
                continue
            pages = np.asarray(tables[g.index], dtype=np.int64).reshape(-1, width)
            n = len(pages)
            if n > self.max_blocks:
                raise RuntimeError(f"sequence {seq_id} holds {n} blocks, the tables have {self.max_blocks}")
            # Entries past the table's end stay as they were: no query reads past its own position.
            diff = np.nonzero((host[row, :n] != pages).any(axis=1))[0]
            if diff.size:
                host[row, diff] = pages[diff]
                index = torch.from_numpy(diff).to(self.device)
                values = torch.from_numpy(np.ascontiguousarray(pages[diff].T)).to(self.device)  # [width, changed]
                self.attention[g.index][:, row, index] = values
                self.pages_written += diff.size * width
