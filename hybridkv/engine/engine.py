"""Engine: serve a local Hugging Face folder with continuous batching over
the paged hybrid KV cache.

    engine = Engine("path/to/model", kv_cache_memory="2GiB")
    outs = engine.generate(["Hello", [1, 17, 42]], SamplingParams(temperature=0, max_tokens=32))

The parts (docs/engine.md): the options, validated once (config.py); the
scheduler, which decides what runs each step and allocates its slots
(scheduler.py); the step's plan, plain arrays (step_plan.py, the table rows
from tables.py); the executor, which runs the plan on the workers
(executor.py: one in process, or one per rank under tensor parallelism,
tensor_parallel.py); the worker, which owns the model, the paged pool and
the tier copies and runs the model over the cache (worker.py; decode steps
at fixed shapes, captured as CUDA graphs on a GPU). A step
(`Engine.step`): schedule -> plan -> execute -> apply the outputs: mark
the computed tokens in the KV cache manager (caches full blocks, releases
what left a window), fork n > 1 children of a prompt just computed, sample
(sampler.py), judge verified drafts (speculative.py), append the tokens,
check stop conditions, free finished sequences.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import json
import logging
import os
import time
import weakref
from collections.abc import Sequence as Seq

import torch

from ..core import KVCacheManager, plan_layout
from ..core.dtypes import dtype_name
from ..core.hf_config import specs_from_config
from ..core.layout import parse_memory
from ..core.specs import with_kv_cache_dtype
from ..core.tiers import BlockStore, TierIndex, TierPlan, TierReport
from ..layers.backends import choose as choose_backend
from ..layers.dtypes import choose_dtype
from ..modeling.loader import checkpoint_dtype, load_model, load_tokenizer, read_config, resolve_model_dir
from ..tiers import TierStore, has_block, kv_identities, list_blocks
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .host_memory import keep_large_allocations
from .key_centres import calibration_ids, centrable_layers, identity_note
from .outputs import CompletionOutput, RequestOutput, TokenIds
from .request import Request, Sequence, Status
from .sampler import sample
from .sampling_params import SamplingParams
from .executor import LocalExecutor
from .scheduler import Scheduled, Scheduler
from .seeding import engine_stream, request_stream
from .speculative import PromptLookup, accept_drafts
from .step_plan import StepPlan, plan_step
from .tables import TableRows
from .worker import PromptLogprobs, Worker

def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """A prompt must leave one token of the context to generate."""
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt of {num_tokens} tokens does not fit the model context of "
                         f"{max_model_len} tokens (one token must remain to generate)")


class Engine:
    def __init__(self, model_dir: str | EngineConfig, **options):
        """`Engine(model_dir, **options)` or `Engine(EngineConfig(...))`:
        every option, its default and its checks are in config.py
        (EngineConfig); a bad one is a ValueError before anything loads.
        The parts, built in order: the model (loaded, split over
        `tensor_parallel_size` processes when above 1), the layout, the
        backend, the executor and its workers, the KV cache manager and the
        scheduler (made again after measuring the key centres of int8
        pages, key_centres.py), the tiers below the pool."""
        config = EngineConfig.build(model_dir, **options)
        config.check_machine()  # the device, the backend and the budgets, before anything loads
        self.engine_config = config
        self.speculative = config.speculative
        self.device = torch.device(config.device)
        self.model_dir = resolve_model_dir(config.model, progress=config.progress)
        self._load_model(config)
        specs = specs_from_config(self.config.to_dict(), dtype=dtype_name(self.dtype),
                                  state_dtype=dtype_name(config.recurrent_state_dtype))
        self.layout = plan_layout(with_kv_cache_dtype(specs, config.kv_cache_dtype),
                                  self._kv_budget(config.kv_cache_memory), block_size=config.block_size)
        self.backend = choose_backend(config.backend, self.device)
        # A backend may not take every layer type, nor what a layer asks beyond the cache (attention sinks).
        self.backend.check_layout(self.layout, self.device, self.model)
        # Keys over int8 pages stored less their layer's centre, measured over this prompt (key_centres.py).
        self.key_centre_ids = calibration_ids(self.tokenizer, self.vocab_size, lambda n: n < self.max_model_len and (
            self.layout.pages_per_request(n + 1, chunk=config.max_num_batched_tokens) < self.layout.num_pages)) \
            if centrable_layers(self.model, self.layout) else []
        tiers = self._tier_options(config) if config.tiers else None
        self._start_workers(config, tiers)
        if self.device.type == "cpu":
            # host_memory.py: no page faults on each step's big tensors; set
            # once loading is done and the worker has packed the weights,
            # so that their temporaries and dropped dense copies are given back.
            keep_large_allocations()
        self.eos_token_ids = self._eos_ids(self.model_dir)
        self.tiers, self.tier_index = None, None
        self._new_manager_and_scheduler(config)
        if self.key_centre_ids:
            self._measure_key_centres(config)
        # The driver rank's storage below the pool (its copies are the worker's), and the
        # scheduler's index of what the tiers hold (the only thing a lookup reads).
        if tiers is not None:
            self.tiers, self.tier_index = self._attach_tiers(tiers)

    def _new_manager_and_scheduler(self, config: EngineConfig) -> None:
        """The KV cache manager, the scheduler and what they count, new."""
        # Where the backend's recurrent ops save states inside prefill chunks, chunks run past checkpoints.
        self.kv = KVCacheManager(self.layout, enable_prefix_caching=config.enable_prefix_caching,
                                 checkpoint_policy=config.checkpoint_policy, enable_kv_events=config.enable_kv_events,
                                 checkpoints_inside_chunks=self.backend.capabilities.checkpoints_inside_chunks)
        self.tables = TableRows(self.layout, self.kv, config.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   on_release=self.tables.release,
                                   propose=self._drafts if self.speculative else None)
        self.random = engine_stream(config.seed)  # unseeded requests' draws (seeding.py)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_failed_tier_loads = 0  # loads that failed (on some rank): their requests recomputed
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified
        self.num_accepted_tokens = 0  # and those the model agreed with
        self.last_step_tier_load_seconds = 0.0  # the last step's wait for tier hits

    def _measure_key_centres(self, config: EngineConfig) -> None:
        """The calibration prompt through the engine's own steps (every
        rank's centres measure their keys, key_centres.py), then a new
        manager and scheduler: nothing of the calibration stays."""
        start = time.perf_counter()
        self.generate([self.key_centre_ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        if any(centre.measuring for centre in self.worker.key_centres):
            raise RuntimeError("the key centres' calibration prompt ended before every centre was measured")
        self._new_manager_and_scheduler(config)
        self.key_centre_seconds = time.perf_counter() - start
        logging.getLogger("hybridkv.engine").info(
            "keys of %d attention layers stored less their centre, measured over %d tokens in %.2f s",
            len(self.worker.key_centres), len(self.key_centre_ids), self.key_centre_seconds)

    def _start_workers(self, config: EngineConfig, tiers: dict | None) -> None:
        """This process's worker (rank 0's) and its executor; with
        tensor_parallel_size > 1 the other ranks' processes first, each to
        build the same worker on its shard."""
        world = config.tensor_parallel_size
        options = dict(max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                       enforce_eager=config.enforce_eager, fixed_shape_decode=config.fixed_shape_decode, world=world,
                       key_centre_tokens=len(self.key_centre_ids))
        if world > 1:
            from .tensor_parallel import TensorParallelExecutor

            executor = TensorParallelExecutor(world, self.model_dir, dict(
                worker=options, device=str(self.device), dtype=dtype_name(self.dtype), layout=self.layout,
                backend=self.backend.name, threads=torch.get_num_threads(), tiers=tiers), self.device,
                timeout=config.tensor_parallel_timeout, heartbeat_timeout=config.tensor_parallel_heartbeat_timeout)
        self.worker = Worker(self.model, self.layout, self.device, self.backend, **options)
        if world > 1:
            executor.worker = self.worker
            executor.wait_until_loaded()
            self.executor = executor
        else:
            self.executor = LocalExecutor(self.worker)

    def _load_model(self, config: EngineConfig) -> None:
        """The weights (this rank's slices under tensor parallelism), the
        tokenizer, and the context they allow."""
        world = config.tensor_parallel_size
        parallel = (0, world) if world > 1 else None
        if parallel and self.device.type == "cpu":  # the ranks share the machine's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        # A context longer than the model's is refused (as vLLM does) before the weights load: positions
        # past it were never trained, and the model's rotary scaling may not reach them.
        text_config = read_config(self.model_dir)[1]
        context = getattr(text_config, "max_position_embeddings", None) or 1 << 20
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} is more than the model's context of "
                             f"{context} tokens (its config's max_position_embeddings)")
        self.max_model_len = config.max_model_len or context
        # Chosen once here (on the CPU "auto" is bfloat16 where the CPU computes it natively), said at
        # start and in stats["dtype"]; the other ranks load the same dtype by name.
        self.dtype, self.dtype_reason = choose_dtype(config.dtype, self.device, checkpoint_dtype(text_config))
        logging.getLogger("hybridkv.engine").info("dtype %s (%s)", dtype_name(self.dtype), self.dtype_reason)
        self.model, self.config = load_model(self.model_dir, dtype=self.dtype, device=self.device,
                                             progress=config.progress, tensor_parallel=parallel)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.vocab_size = self.config.vocab_size

    def _tier_options(self, config: EngineConfig) -> dict:
        """What each rank's tiers are made of (every rank's own: its host
        memory, its disk files under its own identity)."""
        host = config.kv_host_cache_memory
        return dict(host_bytes=parse_memory(host) if host is not None else 0, disk_dir=config.kv_disk_cache,
                    disk_bytes=parse_memory(config.kv_disk_cache_memory), pin=self.device.type == "cuda",
                    identities=kv_identities(self.model_dir, dtype_name(self.dtype), self.layout,
                                             config.tensor_parallel_size, progress=config.progress,
                                             extra=identity_note(self.key_centre_ids)))

    def _attach_tiers(self, options: dict) -> tuple[TierStore, TierIndex]:
        store = TierStore(self.layout.page_size_bytes, len(self.layout.groups), host_bytes=options["host_bytes"],
                          disk_dir=options["disk_dir"], disk_bytes=options["disk_bytes"],
                          identity=options["identities"][0], pin=options["pin"])
        self.worker.tiers = store
        held = []
        if options["disk_dir"]:  # what an earlier run left, in every rank's directory (by name)
            on_every_rank = set.intersection(*(set(list_blocks(options["disk_dir"], identity))
                                               for identity in options["identities"]))
            held = [(group, key, "disk") for group, key in on_every_rank]
        index = TierIndex(len(self.layout.groups), store.first_tier, held)
        self.kv.attach_tier(index)
        self._shared_directory = (options["disk_dir"], options["identities"])  # (kv_role "decode")
        # A process that exits without close() still leaves its cached
        # prefixes on disk (a weak reference: the engine may go first).
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())
        return store, index

    def close(self) -> None:
        """Write what the pool still caches to the disk tier (the next start
        hits it), and stop the tensor-parallel workers. Safe to call more than
        once; without a disk tier or workers, nothing."""
        try:
            if self.tier_index is not None and not self.executor.closed:
                self._copy_tiers(self.tier_index.take())  # what was decided, first
                disk = self.tiers.disk
                if disk is not None and disk.writable:
                    stores = [BlockStore(g, key, tuple(pages)) for g in range(len(self.layout.groups))
                              for key, pages in self.kv.cached_pages(g) if not self.tier_index.on_disk(g, key)]
                    self._copy_tiers(TierPlan(stores, flush=True))
        finally:
            self.executor.close()

    def _copy_tiers(self, plan: TierPlan) -> None:
        """Tier copies outside a step, on every rank, and their report."""
        if plan:
            report = self.executor.copy_tiers(plan)
            if report is not None:
                self._tiers_reported(plan, report)

    def _tiers_reported(self, plan: TierPlan, report: TierReport) -> set[str]:
        """The index follows the report; the requests that read a block
        whose load failed are returned (by sequence id), to compute again."""
        failed = self.tier_index.reported(plan, report)
        if not failed:
            return set()
        self.num_failed_tier_loads += len(failed)
        return set(self.kv.tier_loads_failed(failed))

    def _kv_budget(self, kv_cache_memory) -> int:
        if kv_cache_memory == "auto":
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                return int(free * 0.85)
            return 2 << 30
        return parse_memory(kv_cache_memory)

    def _eos_ids(self, model_dir: str) -> set[int]:
        ids: set[int] = set()

        def add(value):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))

        add(getattr(self.config, "eos_token_id", None))
        path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                add(json.load(f).get("eos_token_id"))
        if self.tokenizer is not None:
            add(self.tokenizer.eos_token_id)
        return ids

    # -- requests ------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: give prompts as lists of token ids")
            if not prompt:
                raise ValueError("empty prompt: a request needs at least one token")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Seq):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("token ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return None, ids

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        """Queue one prompt (text or token ids); returns its request id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} continuations cannot run together: max_num_seqs is "
                             f"{self.scheduler.max_num_seqs}")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        check_prompt_length(len(ids), self.max_model_len)
        fit = self.max_tokens_that_fit(len(ids))
        wanted = 1 if params.max_tokens is None else min(params.max_tokens, self.max_model_len - len(ids))
        if wanted > fit:
            full = len(ids) + wanted
            need = self.layout.pages_per_request(full, chunk=self.scheduler.max_num_batched_tokens)
            raise ValueError(f"a request of {full} tokens needs {need} KV cache pages, the cache holds "
                             f"{self.kv.num_total_pages}: raise kv_cache_memory or lower max_tokens "
                             f"(at most {fit} for this prompt)")
        if params.max_tokens is None:
            # a copy, not dataclasses.replace: that would check the stop strings and
            # build their automaton again, here on the engine's thread
            params = copy.copy(params)
            params.max_tokens = fit
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        request = Request(request_id, text, ids, params, time.perf_counter(), cache_salt)
        seq_id = request_id if params.n == 1 else f"{request_id}#0"
        seq = Sequence(seq_id, request, 0, self._stream(params, 0))
        self.scheduler.add(seq, ids)  # the KV cache manager checks the ids once more
        if self.engine_config.kv_role == "decode" and self.tier_index is not None:  # (not while calibrating)
            self._learn_shared_blocks(seq)
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.num_prompt_tokens += len(ids)
        return request_id

    def max_tokens_that_fit(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with a prompt of this many tokens may
        generate: up to the context, and only as many as the KV cache can
        hold for it alone (0: not even the prompt and one token fit). What
        `max_tokens=None` asks for."""
        chunk, pages = self.scheduler.max_num_batched_tokens, self.kv.num_total_pages

        def fits(length: int) -> bool:
            return self.layout.pages_per_request(length, chunk=chunk) <= pages

        low, high = num_prompt_tokens, self.max_model_len  # fits(low) or low is the prompt; fits(high) unknown
        if high <= low or not fits(low + 1):
            return 0
        if fits(high):
            return high - low
        low += 1
        while high - low > 1:  # pages grow with length: the longest that fits lies in [low, high)
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low - num_prompt_tokens

    @staticmethod
    def _stream(params: SamplingParams, index: int):
        """Continuation `index`'s own random stream, for a seeded request (seeding.py)."""
        if params.seed is None or params.greedy:
            return None
        return request_stream(params.seed, index)

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}")
        for seq in request.sequences:
            if seq.status is not Status.FINISHED:
                self.scheduler.abort(seq)
                seq.finish_reason = "abort"
        request.fork_pending = False
        request.metrics.finish_time = time.perf_counter()
        del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step loop -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule it (the scheduler decides what runs and
        allocates its slots), plan it, execute it (the executor, on every
        worker), record the prompt logprobs it computed, apply its outputs
        (`_apply`). Returns the outputs of the requests it advanced."""
        tiers = self.tiers
        loading = tiers.load_seconds if tiers is not None else 0.0
        steps = self._schedule()
        scored = None
        if steps:
            # The workers make the tier copies the scheduler decided before the forward pass.
            plan = self._plan(steps)
            logits, scored, report = self.executor.execute(plan)
            self.num_steps += 1
            if report is not None:
                lost = self._tiers_reported(plan.tiers, report)
                if lost:
                    steps, logits, scored = self._recompute(lost, steps, logits, scored)
        elif self.tier_index is not None:  # stores decided by a step that schedules nothing: made now
            self._copy_tiers(self.tier_index.take())
        if tiers is not None:
            self.last_step_tier_load_seconds = tiers.load_seconds - loading
        if not steps:
            return []
        if scored is not None:  # before _apply: its outputs carry them
            self._record_prompt_logprobs(steps, scored)
        return self._apply(steps, logits)

    def _recompute(self, lost: set[str], steps: list[Scheduled], logits: torch.Tensor,
                   scored: PromptLogprobs | None) -> tuple:
        """A step some of whose sequences read a block that failed to load
        (never their content): those go back to the head of the queue, their
        blocks freed before anything they computed is cached, to take the hit
        that is left; the others' outputs stand. Returns the step without
        them: its steps, logits rows and prompt-logprob rows."""
        kept, rows, scored_rows = [], [], []
        row = scored_row = 0
        for s in steps:
            n = s.count if s.drafts else int(s.completes)
            positions = s.seq.request.scored_positions(s.start, s.count)
            m = len(positions) if positions else 0
            if s.seq.seq_id not in lost:
                kept.append(s)
                rows.extend(range(row, row + n))
                scored_rows.extend(range(scored_row, scored_row + m))
            row += n
            scored_row += m
        for seq in [seq for seq in self.scheduler.running if seq.seq_id in lost]:
            self.scheduler.preempt(seq)
            seq.request.metrics.first_scheduled_time = None  # its hit is counted again when admitted
        logits = logits[rows] if logits.shape[0] else logits
        if scored is not None:
            scored = PromptLogprobs(*(t[scored_rows] for t in scored))
        return kept, logits, scored

    def _schedule(self) -> list[Scheduled]:
        steps = self.scheduler.schedule()  # admissions take their tier hits here
        now = time.perf_counter()
        for s in steps:
            if s.seq.request.metrics.first_scheduled_time is None:
                s.seq.request.metrics.first_scheduled_time = now
        return steps

    def _plan(self, steps: list[Scheduled]) -> StepPlan:
        """The step for the workers: its arrays, and what comes first (page
        copies of forks, table changes, the tier copies)."""
        plan = plan_step(steps, [self.tables.row(s.seq.seq_id) for s in steps])
        if self.kv.checkpoints_inside_chunks:
            plan.checkpoint_saves = self._checkpoint_saves(steps)
        plan.copies = [pair for pairs in self.kv.take_copies().values() for pair in pairs]
        plan.table_changes = self.tables.changes()
        if self.tier_index is not None:
            plan.tiers = self.tier_index.take() or None
        return plan

    def _checkpoint_saves(self, steps: list[Scheduled]) -> list[tuple]:
        """The recurrent states the step saves inside its prefill chunks:
        (sequence index, tokens of its chunk before the checkpoint, group,
        pages) for each checkpoint the manager gave a block inside the
        chunk's tokens."""
        saves = []
        for i, s in enumerate(steps):
            if s.count > 1 and not s.drafts:
                for g, entries in self.kv.get_checkpoint_pages(s.seq.seq_id).items():
                    saves.extend((i, position - s.start, g, pages) for position, pages in entries)
        return saves

    def _apply(self, steps: list[Scheduled], logits: torch.Tensor) -> list[RequestOutput]:
        """After the forward pass: the computed tokens join the cache, a
        prompt with n > 1 forks its children, every sequence that reached
        the end of its tokens samples the next one, verified drafts are
        judged, and stopped sequences finish."""
        self._mark_computed(steps)
        if self.engine_config.kv_role == "prefill" and self.tier_index is not None:  # (not while calibrating)
            self._hand_off(steps)
        children = self._fork_completed_prompts(steps)
        sampling, verifying = self._logits_rows(steps, children)
        touched: dict[str, Request] = {}
        self._sample(sampling, logits, touched)
        if verifying:
            self._verify_drafts(verifying, logits, touched, steps)
        return self._outputs(touched)

    def _hand_off(self, steps: list[Scheduled]) -> None:
        """kv_role "prefill": the prompts this step completed leave, in the
        shared directory, the blocks a hit of them reads (their last whole
        block's hit, as a decode engine's lookup of the same prompt takes),
        written now, before any later step may reuse their pages."""
        bs = self.layout.block_size
        stores = []
        for s in steps:
            request = s.seq.request
            if not s.completes or s.drafts or s.start + s.count != len(request.prompt_token_ids):
                continue
            hit = (len(request.prompt_token_ids) - 1) // bs * bs
            blocks = self.kv.blocks_for_hit(s.seq.seq_id, hit)
            page = self.layout.page_size_bytes
            request.metrics.kv_handoff_bytes = sum(len(pages) for _, _, pages in blocks) * page
            request.metrics.kv_all_layers_bytes = self.layout.all_layers_bytes(hit)
            stores += [BlockStore(g, key, pages) for g, key, pages in blocks if not self.tier_index.on_disk(g, key)]
        if stores:
            self._copy_tiers(TierPlan(stores, flush=True))

    def _learn_shared_blocks(self, seq: Sequence) -> None:
        """kv_role "decode": the blocks of the new request's prompt that the
        shared directory holds now, on every rank (by name: nothing is
        read), join the tiers' index, so its lookup may take them."""
        num_tokens = len(seq.token_ids)
        keys = self.kv.block_keys(seq.seq_id, 0, (num_tokens - 1) // self.layout.block_size * self.layout.block_size)
        index = self.tier_index.index
        directory, identities = self._shared_directory
        self.tier_index.learn((g, key, "disk") for g in range(len(index)) for key in keys
                              if key not in index[g] and all(has_block(directory, i, g, key) for i in identities))

    @staticmethod
    def _record_prompt_logprobs(steps: list[Scheduled], scored: PromptLogprobs) -> None:
        """The step's prompt-logprob rows (in the plan's order: step_plan.py)
        join their requests' lists: for each position, the prompt's token
        first, then the request's top tokens in order."""
        token, top, top_ids = scored.token.tolist(), scored.top.tolist(), scored.top_ids.tolist()
        row = 0
        for s in steps:
            request = s.seq.request
            positions = request.scored_positions(s.start, s.count)
            if not positions:
                continue
            k, prompt, entries = request.params.prompt_logprobs, request.prompt_token_ids, request.prompt_logprobs
            for position in positions:
                entry = {prompt[position + 1]: token[row]}
                entry.update(zip(top_ids[row][:k], top[row][:k]))
                entries.append(entry)
                row += 1

    def _mark_computed(self, steps: list[Scheduled]) -> None:
        """Decodes in one call; prefill chunks one by one. A step that
        verifies drafts is marked once they are judged (_verify_drafts)."""
        kv = self.kv
        kv.mark_computed_many([s.seq.seq_id for s in steps if s.count == 1], 1)
        for s in steps:
            if s.count > 1 and not s.drafts:
                kv.mark_computed(s.seq.seq_id, s.count)

    def _fork_completed_prompts(self, steps: list[Scheduled]) -> dict[str, list[Sequence]]:
        """A request with n > 1 whose prompt this step completed makes its
        n - 1 children now: they share the computed prompt's blocks and
        sample their first tokens from its last logits row. Returns the
        children by the parent's sequence id."""
        return {s.seq.seq_id: self._fork(s.seq) for s in steps
                if s.completes and not s.drafts and s.seq.request.fork_pending}

    @staticmethod
    def _logits_rows(steps: list[Scheduled], children: dict[str, list[Sequence]]):
        """Who reads which logits row (the workers return one row per step
        that completes its known tokens, in order, and one per token of a
        step that verifies drafts): (sequence, row) pairs that sample one
        token, forked children at their parent's row; (step, first row)
        pairs whose drafts are judged."""
        sampling: list[tuple[Sequence, int]] = []
        verifying: list[tuple[Scheduled, int]] = []
        row = 0
        for s in steps:
            if s.drafts:
                verifying.append((s, row))
                row += s.count
            elif s.completes:
                sampling.extend((seq, row) for seq in (s.seq, *children.get(s.seq.seq_id, ())))
                row += 1
        return sampling, verifying

    def _sample(self, sampling: list[tuple[Sequence, int]], logits: torch.Tensor,
                touched: dict[str, Request]) -> None:
        """Sample one token for each (sequence, row), append it, and stop
        the sequences it ends."""
        if not sampling:
            return
        rows = [r for _, r in sampling]
        # Usually every logits row samples once, in order: no copy of a [rows, vocab] tensor then.
        chosen = logits if rows == list(range(logits.shape[0])) else \
            logits[torch.tensor(rows, device=logits.device)]
        tokens = sample(chosen, [q.request.params for q, _ in sampling], [q.stream for q, _ in sampling],
                        self.random, self.backend.row_max)
        sampled = [(seq, token) for (seq, _), token in zip(sampling, tokens) if token is not None]
        self.kv.append_token_ids_many([seq.seq_id for seq, _ in sampled], [token for _, token in sampled])
        now = time.perf_counter()
        for (seq, _), token in zip(sampling, tokens):
            request = seq.request
            touched[request.request_id] = request
            if token is None:
                self._finish(seq, "error")
                continue
            self.num_generated_tokens += 1
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason:
                self._finish(seq, reason)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The touched requests' outputs; finished ones leave the engine."""
        now = time.perf_counter()
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finish_time = now
                del self.requests[request.request_id]
            outputs.append(self._output(request))
        return outputs

    # -- speculative decoding (speculative.py) ----------------------------------
    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence's next step (the scheduler
        asks): at most what the step budget, max_tokens and the context leave,
        and never past the next Mamba checkpoint (the state there must exist,
        as without speculation)."""
        k, low, high = self.speculative
        tokens = seq.token_ids
        k = min(k, budget - 1, seq.request.params.max_tokens - seq.num_outputs - 1,
                self.max_model_len - len(tokens) - 1)
        checkpoint = self.kv.next_checkpoint(seq.seq_id)
        if checkpoint is not None:
            k = min(k, checkpoint - len(tokens))  # the step ends at len(tokens) + k
        if k <= 0:
            return []
        if seq.drafter is None:
            seq.drafter = PromptLookup(low, high)
        return seq.drafter.propose(tokens, k)

    def _verify_drafts(self, verified: list[tuple[Scheduled, int]], logits: torch.Tensor,
                       touched: dict[str, Request], steps: list[Scheduled]) -> None:
        """Judge each verified step's drafts (its logits rows from `row`),
        append what it emits up to a stop, leave the Mamba states after the
        last kept token, then mark the kept tokens computed: the manager drops
        the rejected slots (docs/architecture.md)."""
        kv = self.kv
        kept: dict[str, int] = {}
        ends: list[tuple[Sequence, str | None]] = []
        for s, row in verified:
            seq = s.seq
            touched[seq.request.request_id] = seq.request
            self.num_draft_tokens += len(s.drafts)
            tokens = accept_drafts(logits[row:row + s.count], s.drafts, seq.request.params, seq.stream,
                                   self.random)
            if tokens is None:
                kept[seq.seq_id] = 0
                ends.append((seq, "error"))
                continue
            self.num_accepted_tokens += len(tokens) - 1
            seq.drafter.record(len(tokens) - 1)
            reason, emitted = None, 0
            for token in tokens:  # one at a time: a stop ends the step's tokens where it happens
                kv.append_token_ids(seq.seq_id, [token])
                emitted += 1
                reason = self._stop_reason(seq, token)
                if reason:
                    break
            self.num_generated_tokens += emitted
            kept[seq.seq_id] = min(emitted, len(tokens) - 1)  # the last emitted token is not computed yet
            ends.append((seq, reason))
        place = {s.seq.seq_id: i for i, s in enumerate(steps)}  # the workers know sequences by it
        self.executor.keep_accepted({place[seq_id]: n for seq_id, n in kept.items()})
        for seq, reason in ends:
            kv.mark_computed(seq.seq_id, 1 + kept[seq.seq_id])
            if reason:
                self._finish(seq, reason)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the children share the computed prompt's blocks."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child_id = f"{request.request_id}#{index}"
            self.kv.fork(parent.seq_id, child_id)
            child = Sequence(child_id, request, index, self._stream(request.params, index))
            self.scheduler.add_running(child)
            request.sequences.append(child)
            children.append(child)
        request.fork_pending = False
        return children

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and self.tokenizer is not None and self._stop_string(seq, params):
            return "stop"
        if seq.num_outputs >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _stop_string(self, seq: Sequence, params: SamplingParams) -> bool:
        """Does the new token complete a stop string? The text grows by the
        new token's characters only, and the stop strings' automaton reads
        just those (stop_strings.py): work per new character, whatever the
        number of stop strings or of tokens generated so far. The text is
        cut where the earliest stop string begins."""
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        new = seq.detokenizer.update(seq.token_ids, seq.num_prompt_tokens)
        if not new:
            return False
        seq.stop_state, found = params.stop_strings.feed(seq.stop_state, new)
        if found is None:
            return False
        text = seq.detokenizer.text
        seq.text = text[:len(text) - len(new) + found]
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def _output(self, request: Request) -> RequestOutput:
        """Text is decoded once a sequence finishes (streaming callers decode
        the token ids themselves)."""
        completions = []
        for seq in request.sequences:
            text = seq.text
            if seq.status is Status.FINISHED:
                token_ids = seq.output_ids  # one copy, at the end
                if text is None:
                    text = ""
                    if self.tokenizer is not None:
                        text = self.tokenizer.decode(token_ids, skip_special_tokens=request.params.skip_special_tokens)
            else:
                token_ids = TokenIds(seq.token_ids, seq.num_prompt_tokens)  # a live view: no copy per step
                text = text or ""
            completions.append(CompletionOutput(seq.index, text, token_ids, seq.finish_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, request.metrics, request.prompt_logprobs)

    # -- batch API -------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in order."""
        from tqdm.auto import tqdm

        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
        except ValueError:
            for request_id in ids:
                self.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                outputs = self.step()
                if not outputs and not self.scheduler.has_work():
                    raise RuntimeError("the engine stopped with unfinished requests")
                for out in outputs:
                    if out.finished and out.request_id in ids:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def drain(self) -> dict[str, RequestOutput]:
        """Step until no request is left; the final output of each request
        that finished meanwhile, by request id."""
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        return finished

    def take_kv_events(self) -> list:
        """The manager's KV events since the last call, in order (needs
        enable_kv_events=True)."""
        return self.kv.take_events()

    @property
    def stats(self) -> dict:
        cache = self.kv.stats
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "generated_tokens": self.num_generated_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "steps": self.num_steps,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "dtype": {"weights": dtype_name(self.dtype), "why": self.dtype_reason},
            **({"kv_key_centres": {"layers": len(self.worker.key_centres), "tokens": len(self.key_centre_ids),
                                   "seconds": self.key_centre_seconds}} if self.key_centre_ids else {}),
            "backend": {**self.worker.prepare_report.as_dict(), "routes": dict(self.worker.routes)},
            "prefix_queried_tokens": cache.queried_tokens,
            "prefix_hit_tokens": cache.hit_tokens,
            "prefix_hit_rate": cache.hit_rate,
            "kv_usage": self.kv.usage,
            "kv_pages_in_use_by_group": self.kv.pages_in_use_by_group(),
            "kv_tier_loads_by_group": {t: list(n) for t, n in (cache.tier_loads or {}).items()},
            **({f"kv_tier_{k}": v for k, v in self.tiers.describe().items()} if self.tiers is not None else {}),
            **({"kv_tier_failed_loads": self.num_failed_tier_loads} if self.tiers is not None else {}),
            **({"kv_tier_last_step_load_seconds": self.last_step_tier_load_seconds} if self.tiers is not None
               else {}),
        }
