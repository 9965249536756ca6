"""The connector's worker side: bytes between vLLM's per-layer KV tensors
and hybridkv's tier storage (tiers/store.py's TierStore: a host slab with
an LRU, then a disk directory with an LRU by byte budget, written
atomically and checked when read).

A block of group g is the slice of block id b in each of the group's
layer tensors, one page per layer: `[width, page]` bytes, the shape the
store keeps. A plan's loads run after the step's forward pass (they target
blocks of a request that waits for them, which that pass does not touch),
then its stores (blocks a finished request still holds, or blocks pinned
out of the free queue: nothing writes either). A load whose content the
tiers lost or find damaged fails its whole request: vLLM frees its blocks
without caching them and computes it again, and the store has already
dropped the bad key (its move goes back in the report).
"""

from __future__ import annotations

import torch

from ...tiers import TierStore
from .groups import TierGroups
from .options import TierOptions
from .plan import TierPlan, TierReport


class LayerBlocks:
    """One layer's KV tensor seen as blocks of bytes: `read(ids)` gives
    `[len(ids), page]` uint8, `write(id, page)` puts one back."""

    def __init__(self, name: str, tensor: torch.Tensor, num_blocks: int, page: int):
        dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
        if not dims:
            raise ValueError(f"layer {name}: no dimension of its KV tensor {tuple(tensor.shape)} counts the "
                             f"{num_blocks} blocks")
        self.blocks = tensor.movedim(dims[0], 0)  # a view: block id first
        self.shape = self.blocks.shape[1:]
        nbytes = self.shape.numel() * tensor.element_size()
        if nbytes != page:
            raise ValueError(f"layer {name}: a block is {nbytes} bytes, the group's page {page}")

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.blocks[ids]  # a gathered copy, contiguous
        return out.view(torch.uint8).reshape(len(ids), -1)

    def write(self, block_id: int, page: torch.Tensor) -> None:
        target = self.blocks[block_id]
        target.copy_(page.to(target.device).view(target.dtype).view(self.shape))


class TierWorker:
    def __init__(self, groups: TierGroups, options: TierOptions, identity: bytes, producer: bool = False):
        # `producer` (vLLM's kv_role "kv_producer"): stores go straight to
        # disk, where a consumer (another vLLM) reads them.
        self.producer = producer
        self.groups = groups
        self.options = options
        self.identity = identity
        self.store: TierStore | None = None
        self.layers: list[list[LayerBlocks]] = []
        self.plan: TierPlan | None = None
        self.received: set[str] = set()
        self.failed: set[str] = set()
        self.released: set[str] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's register_kv_caches: the layers' tensors, and the store."""
        layout = self.groups.layout
        page = layout.page_size_bytes
        missing = [n for g in layout.groups for n in g.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV tensor for layers {missing}")
        self.layers = [[LayerBlocks(n, kv_caches[n], layout.num_pages, page) for n in g.layer_names]
                       for g in layout.groups]
        device = next(iter(kv_caches.values())).device
        opts = self.options
        self.store = TierStore(page, len(layout.groups), host_bytes=opts.host_memory, disk_dir=opts.disk_dir,
                               disk_bytes=opts.disk_memory, identity=self.identity, pin=device.type == "cuda")

    # -- a step -------------------------------------------------------------
    def begin(self, plan: TierPlan) -> None:
        self.plan = plan

    def load(self) -> None:
        """vLLM's start_load_kv (after the forward pass: every load is
        asynchronous): the plan's loads, each all or nothing."""
        plan = self.plan
        if plan is None:
            return
        if plan.clear:
            self.store.clear()
        by_request: dict[str, list] = {request_id: [] for request_id in plan.loading}
        for load in plan.loads:
            by_request[load.request_id].append(load)
        for request_id, loads in by_request.items():
            self.received.add(request_id)
            if not self._load(loads):
                self.failed.add(request_id)

    def _load(self, loads: list) -> bool:
        for load in loads:
            content = self.store.read(load.group, load.key)
            if content is None or content.shape[0] != len(self.layers[load.group]):
                return False
            (block_id,) = load.pages
            for layer, page in zip(self.layers[load.group], content):
                layer.write(block_id, page)
        return True

    def save(self) -> None:
        """vLLM's wait_for_save: the plan's stores, read one gather per
        layer and group."""
        plan = self.plan
        if plan is None:
            return
        by_group: dict[int, list] = {}
        for store in plan.stores:
            by_group.setdefault(store.group, []).append((store.key, store.pages[0]))
        for group, items in by_group.items():
            ids = torch.tensor([block_id for _, block_id in items], dtype=torch.long)
            pages = torch.stack([layer.read(ids) for layer in self.layers[group]], dim=1).cpu()
            for (key, _), content in zip(items, pages):
                if self.producer:
                    self.store.write_disk(group, key, content)
                else:
                    self.store.keep(group, key, content)
        self.released.update(plan.released)

    def results(self) -> tuple[set, set, set]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        out = self.released, self.received, self.failed
        self.released, self.received, self.failed = set(), set(), set()
        return out

    def report(self) -> TierReport | None:
        """vLLM's build_connector_worker_meta: the step carried out and the
        index changes, when there are any."""
        plan, self.plan = self.plan, None
        if plan is None or not plan.has_work():
            return None
        return TierReport(plan.step, self.store.take_moves())

    def flush(self) -> int:
        """vLLM's shutdown: what host memory holds is written to disk too
        (the disk otherwise has only what host memory pushed out), so the
        next start hits it. Returns the blocks written."""
        store = self.store
        if store is None or store.host is None or store.disk is None or not store.disk.writable:
            return 0
        written = 0
        for item in list(store.host.blocks):  # oldest first: the newest survive a full budget
            store.disk.write(*item, store.host.get(item))
            written += item in store.disk.files
        return written
