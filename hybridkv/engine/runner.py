"""The model runner: turns a scheduled step into tensors, runs the model over
the paged cache, and returns the logits to sample from.

All per-step metadata is built here, once per KV cache group (not per
layer), with numpy over the whole batch: for every new token the page and
slot it is stored at (one page per column of a multi-page block), and for
every query the pages it reads and which of their keys it may see.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import KVCacheManager
from ..core.layout import KVCacheLayout
from ..layers import backend
from ..layers.batch import ForwardBatch, MambaBatch
from ..layers.kv_buffers import KVBuffers
from ..layers.paged_attention import AttentionMetadata, DecodeGroup, PrefillSegment, visible
from ..modeling.base import CausalLM
from .scheduler import Scheduled


# Decode queries attended together: bigger groups mean fewer calls, smaller
# ones less padding read when lengths differ. Split a group in two (at most
# DECODE_GROUP queries apart) only where it would read over PADDING_LIMIT
# times the blocks its queries need.
DECODE_GROUP = 16
PADDING_LIMIT = 1.25


def decode_groups(lengths: np.ndarray) -> list[np.ndarray]:
    """Indices of `lengths` (blocks each query reads), shortest first, in
    groups that read little padding."""
    order = np.argsort(lengths, kind="stable")
    groups, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order):
            groups.append(order[start:end])
            break
        size = end + 1 - start
        padded = size * lengths[order[end]]
        if size > DECODE_GROUP and padded > PADDING_LIMIT * lengths[order[start:end + 1]].sum():
            groups.append(order[start:end])
            start = end
    return groups


class ModelRunner:
    def __init__(self, model: CausalLM, layout: KVCacheLayout, kv: KVCacheManager, device: torch.device):
        self.model = model
        self.layout = layout
        self.kv = kv
        self.device = device
        self.buffers = KVBuffers(layout, device)
        self._table_cache: dict[str, tuple] = {}
        for name, module in model.cache_layers().items():
            view = layout.layer_views.get(name)
            if view is None:
                raise ValueError(f"layer {name} has no place in the KV cache layout")
            module.layer_name = name
            module.group = view.group
            module.column = view.column
            if layout.groups[view.group].kind != "mamba":
                module.cache = self.buffers.attention_cache(name)

    @torch.inference_mode()
    def execute(self, steps: list[Scheduled]) -> torch.Tensor:
        """Run one step; logits [sampled rows, vocab] for the steps that
        complete their known tokens, in order."""
        for pairs in self.kv.take_copies().values():
            self.buffers.copy_pages(pairs)
        batch, writes = self.prepare(steps)
        hidden = self.model(batch)
        for group, pages in writes.items():
            self.buffers.scatter_states(pages, batch.mamba[group].states)
        rows, end = [], 0
        for step in steps:
            end += step.count
            if step.completes:
                rows.append(end - 1)
        if not rows:
            return torch.empty(0, device=self.device)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    def _tables(self, steps: list[Scheduled]) -> list:
        """The block tables (page ids per group) of the step's sequences,
        kept from the previous step while the manager has not changed them."""
        previous, current = self._table_cache, {}
        out = []
        for s in steps:
            seq_id = s.seq.seq_id
            version = self.kv.table_version(seq_id)
            cached = previous.get(seq_id)
            if cached is None or cached[0] != version:
                cached = (version, self.kv.get_block_tables(seq_id))
            current[seq_id] = cached
            out.append(cached[1])
        self._table_cache = current
        return out

    # -- metadata ----------------------------------------------------------
    def prepare(self, steps: list[Scheduled]):
        kv, device = self.kv, self.device
        counts = np.array([s.count for s in steps], dtype=np.int64)
        starts = np.array([s.start for s in steps], dtype=np.int64)
        total = int(counts.sum())
        first_row = np.concatenate(([0], np.cumsum(counts)[:-1]))
        req_of_token = np.repeat(np.arange(len(steps)), counts)
        positions = np.arange(total) - np.repeat(first_row, counts) + np.repeat(starts, counts)
        input_ids = np.fromiter((t for s in steps for t in s.seq.token_ids[s.start:s.start + s.count]),
                                dtype=np.int64, count=total)
        tables = self._tables(steps)
        batch = ForwardBatch(torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device),
                             self.buffers)
        writes = {}
        decode = counts == 1
        for group in self.layout.groups:
            if group.kind == "mamba":
                batch.mamba[group.index], writes[group.index] = self._mamba(group, steps, first_row, decode)
            else:
                batch.attention[group.index] = self._attention(
                    group, [t[group.index] for t in tables], req_of_token, positions, starts, counts, first_row,
                    decode)
        return batch, writes

    def _attention(self, group, rows, req_of_token, positions, starts, counts, first_row, decode):
        bs, width, device = group.block_size, group.pages_per_block, self.device
        spec = group.spec
        kind = spec.kind
        window = getattr(spec, "sliding_window", 0)
        chunk = getattr(spec, "chunk_size", 0)
        table = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
        for i, r in enumerate(rows):
            table[i, :len(r)] = r
        columns = np.arange(width)[:, None]
        store_pages = table[req_of_token[None, :], (positions // bs)[None, :] * width + columns]
        meta = AttentionMetadata(kind, window, chunk, bs, torch.from_numpy(store_pages).to(device),
                                 torch.from_numpy(positions % bs).to(device))

        def first_visible(q):
            if kind == "sliding_window":
                return np.maximum(0, q - window + 1)
            if kind == "chunked_local":
                return q // chunk * chunk
            return np.zeros_like(q)

        dec = np.nonzero(decode)[0]
        if dec.size:
            q_all = starts[dec]
            lo_all, hi_all = first_visible(q_all) // bs, q_all // bs
            # Shortest first, in groups: each group reads only up to its longest.
            for part in decode_groups(hi_all - lo_all + 1):
                q, lo, hi, rows = q_all[part], lo_all[part], hi_all[part], dec[part]
                nb = int((hi - lo).max()) + 1
                blocks = lo[:, None] + np.arange(nb)[None, :]
                inside = blocks <= hi[:, None]
                pages = table[rows[None, :, None], np.minimum(blocks, hi[:, None])[None] * width + columns[:, :, None]]
                pages = np.where(inside[None], pages, 0)
                key_pos = (blocks[:, :, None] * bs + np.arange(bs)).reshape(len(rows), nb * bs)
                mask = visible(kind, window, chunk, torch.from_numpy(q[:, None]), torch.from_numpy(key_pos))
                mask &= torch.from_numpy(np.repeat(inside, bs, axis=1))
                meta.decodes.append(DecodeGroup(
                    torch.from_numpy(first_row[rows]).to(device), torch.from_numpy(pages).to(device),
                    mask.to(device), torch.from_numpy(q).to(device), torch.from_numpy(lo * bs).to(device),
                    torch.from_numpy(hi - lo + 1).to(device)))
        for i in np.nonzero(~decode)[0]:
            start, count = int(starts[i]), int(counts[i])
            lo, hi = int(first_visible(np.array([start]))[0]) // bs, (start + count - 1) // bs
            blocks = np.arange(lo, hi + 1)
            pages = table[i, blocks[None, :] * width + columns]
            q_pos = torch.arange(start, start + count)[:, None]
            k_pos = torch.from_numpy((blocks[:, None] * bs + np.arange(bs)).reshape(-1))[None, :]
            meta.prefills.append(PrefillSegment(int(first_row[i]), count, torch.from_numpy(pages).to(device),
                                                visible(kind, window, chunk, q_pos, k_pos).to(device),
                                                start, lo * bs))
        return meta

    def _mamba(self, group, steps, first_row, decode):
        states = [self.kv.get_state_blocks(s.seq.seq_id)[group.index] for s in steps]
        width = group.pages_per_block
        read = np.array([r if r is not None else (0,) * width for r, _ in states], dtype=np.int64)
        write = np.array([w for _, w in states], dtype=np.int64)
        zero = np.array([r is None for r, _ in states])
        device = self.device
        rows = np.nonzero(decode)[0]
        if rows.size and backend.use_triton(self.buffers.pool):
            return self._mamba_in_pool(read, write, zero, rows, np.nonzero(~decode)[0], steps, first_row)
        gathered = self.buffers.gather_states(torch.from_numpy(read).to(device),
                                              torch.from_numpy(zero).to(device) if zero.any() else None)
        batch = MambaBatch(gathered, torch.from_numpy(rows).to(device), torch.from_numpy(first_row[rows]).to(device),
                           [(int(i), int(first_row[i]), steps[i].count) for i in np.nonzero(~decode)[0]])
        return batch, torch.from_numpy(write).to(device)

    def _mamba_in_pool(self, read, write, zero, decodes, prefills, steps, first_row):
        """Kernel path: the decode requests' states stay in the pool (the
        kernels read and write their pages); only prefill rows are gathered
        and written back."""
        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        if prefills.size:
            zeros = dev(zero[prefills]) if zero[prefills].any() else None
            gathered = self.buffers.gather_states(dev(read[prefills]), zeros)
        else:
            gathered = torch.empty(0, read.shape[1] * self.buffers.page_size, dtype=torch.uint8, device=self.device)
        batch = MambaBatch(gathered, dev(np.zeros(0, dtype=np.int64)), dev(first_row[decodes]),
                           [(j, int(first_row[i]), steps[i].count) for j, i in enumerate(prefills)],
                           decode_pages=(dev(read[decodes]), dev(write[decodes]), dev(zero[decodes])))
        return batch, dev(write[prefills])
