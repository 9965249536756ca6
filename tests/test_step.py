"""The shape of a step: the decode step at fixed shapes has no host syncs
and no data-dependent shapes (the CPU proxy for a CUDA graph: it traces as
one graph under torch.compile and gives the eager step's logits and state
updates); the host work of keeping block tables does not grow with the
context; and no module of hybridkv imports itself back."""

from __future__ import annotations

import ast
import gc
import os
import re

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.tiny_models import tiny_model_dir

ROOT = os.path.join(os.path.dirname(__file__), "..", "hybridkv")


def decode_ready_engine(name: str, **kw) -> tuple[Engine, int]:
    """An engine whose next step decodes three sequences; the decode buffers
    filled for it. Returns (engine, bucket size)."""
    engine = Engine(tiny_model_dir(name), kv_cache_memory="16MiB", progress=False, fixed_shape_decode=True,
                    max_model_len=256, max_num_seqs=8, **kw)
    for prompt in ([5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while engine.scheduler.waiting or any(engine.kv.num_computed_tokens(s.seq_id) < len(s.token_ids) - 1
                                          for s in engine.scheduler.running):
        engine.step()
    steps = engine.scheduler.schedule()
    assert len(steps) == 3 and all(s.count == 1 for s in steps)
    worker = engine.worker
    rows = [engine.tables.row(s.seq.seq_id) for s in steps]
    worker.tables.apply(engine.tables.changes())
    size = worker.bucket(len(steps))
    assert size == 4  # one padded row
    worker.decode_ids[:size] = 0
    worker.decode_positions[:size] = 0
    worker.decode_table_rows[:size] = worker.tables.pad_row
    worker.decode_ids[:3] = torch.tensor([s.seq.token_ids[s.start] for s in steps])
    worker.decode_positions[:3] = torch.tensor([s.start for s in steps])
    worker.decode_table_rows[:3] = torch.tensor(rows)
    return engine, size


@pytest.mark.parametrize("name,backend", [(name, backend) for name in ("tiny-gemma3", "tiny-jamba", "tiny-gpt-oss")
                                          for backend in ("torch", "cpu")]
                         # (Gated DeltaNet's states and experts: the cpu backend changes nothing they run)
                         + [("tiny-qwen3-next", "torch")])
def test_hybrid_fixed_shape_decode_step_traces_as_one_graph_and_matches_eager(name, backend):
    # fullgraph=True fails on any graph break: a .item() or .tolist(), a
    # Python branch on a tensor's value, an op whose output shape depends on
    # data (nonzero, boolean indexing). aot_eager also functionalizes the
    # step's writes to the KV pool (K/V stores, Mamba states). inductor gives
    # the same (checked by hand: 49 s to compile tiny-gemma3 here, too slow for CI).
    # A traced step runs torch's ops where the "cpu" backend's eager step
    # runs its C norms and activations (backends/cpu/modules.py), and
    # aot_eager decomposes some of torch's own (F.linear into a transpose and
    # a product): the same writes to float32 rounding.
    engine, size = decode_ready_engine(name, backend=backend)
    worker = engine.worker
    pool = worker.buffers.pool
    before = pool.clone()
    with torch.inference_mode():
        eager = worker.decode_forward(size).clone()
    after_eager = pool.clone()
    pool.copy_(before)
    compiled = torch.compile(worker.decode_forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        traced = compiled(size)
    torch.testing.assert_close(traced[:3], eager[:3], atol=1e-5, rtol=1e-5)
    pages = worker.layout.num_pages  # the pool's bytes, read as the float32 K/V and states they hold
    torch.testing.assert_close(pool[:pages].view(torch.float32), after_eager[:pages].view(torch.float32),
                               atol=1e-5, rtol=1e-5, equal_nan=True)
    assert not torch.equal(after_eager, before)  # the step did write K/V (and states)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_graph_only_the_collector_frees_cannot_break_a_later_capture(monkeypatch):
    # An engine dropped while in a reference cycle keeps its CUDA graphs
    # until the collector runs; freed during another engine's capture, a
    # graph resets itself there, which CUDA forbids while a stream captures.
    # The collection is forced inside the capture here (the collector's own
    # runs come with allocations, now and then).
    from hybridkv.engine.worker import Worker

    kw = dict(kv_cache_memory="16MiB", progress=False, max_model_len=256, max_num_seqs=4, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    eager = Engine(tiny_model_dir("tiny-gemma3"), enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    collecting = gc.isenabled()
    gc.disable()  # only the collections below, where this test puts them
    try:
        first = Engine(tiny_model_dir("tiny-gemma3"), **kw)
        assert first.worker.graphs
        cycle = [first]
        cycle.append(cycle)
        del first, cycle
        capture_forward = Worker.decode_forward

        def collect_while_capturing(self, size):
            if torch.cuda.is_current_stream_capturing():
                gc.collect()
            return capture_forward(self, size)

        monkeypatch.setattr(Worker, "decode_forward", collect_while_capturing)
        second = Engine(tiny_model_dir("tiny-gemma3"), **kw)
    finally:
        if collecting:
            gc.enable()
    outputs = second.generate(prompts, params, use_tqdm=False)
    assert any(route.endswith(":graph") for route in second.worker.routes)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-jamba"])
def test_table_update_work_per_decode_step_does_not_grow_with_context(name):
    # Pages written to the device tables over 48 decode steps, at 1K and at
    # 8K tokens of context: the same (each block boundary appends one page
    # per attention group; a sliding window's release changes the host's
    # null entries only; a Mamba state block moves at checkpoints).
    layouts = []

    def written(context):
        engine = Engine(tiny_model_dir(name), kv_cache_memory="64MiB", progress=False, max_model_len=8192,
                        max_num_batched_tokens=8192, enable_prefix_caching=False, block_size=16)
        layouts.append(engine.layout)
        engine.add_request([(7 * j) % 900 + 5 for j in range(context)],
                           SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        engine.step()  # the prefill
        for _ in range(4):
            engine.step()
        start = engine.tables.pages_written
        for _ in range(48):
            engine.step()
        return engine.tables.pages_written - start

    short, long = written(1000), written(8000)
    # At most: per attention group, one block appended and one released at each
    # of the (48 / block_size + 1) boundaries; per Mamba group, its state block moving.
    layout = layouts[0]
    boundaries = 48 // layout.block_size + 1
    bound = sum(g.pages_per_block * 2 * boundaries for g in layout.groups)
    assert long == short and short <= bound


def import_graph() -> dict[str, set[str]]:
    """Module -> the hybridkv modules it imports, module-level or deferred
    into a function."""
    graph: dict[str, set[str]] = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            module = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            package = module if name == "__init__.py" else module.rpartition(".")[0]
            edges = graph.setdefault(module, set())
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package
                        for _ in range(node.level - 1):
                            base = base.rpartition(".")[0]
                        target = f"{base}.{node.module}" if node.module else base
                    else:
                        target = node.module or ""
                    # `from package import module` imports the module; `from
                    # module import name` the module (kept apart below).
                    targets = [(target, tuple(f"{target}.{a.name}" for a in node.names))]
                elif isinstance(node, ast.Import):
                    targets = [(a.name, ()) for a in node.names]
                else:
                    continue
                edges.update(t for t in targets if t[0].startswith("hybridkv"))
    modules = set(graph)
    out = {}
    for m, edges in graph.items():
        named = set()
        for target, members in edges:
            submodules = [x for x in members if x in modules]
            named.update(submodules if submodules else [target])
        out[m] = {t for t in named if t in modules and t != m}
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles_in_hybridkv():
    # Every import inside the package, module-level or deferred into a
    # function, points one way: no module reaches itself.
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# hybridkv's packages (and top-level modules) from the bottom floor up
# (docs/architecture.md, "Floors"): each imports only what is on a floor below.
FLOORS = [
    {"hybridkv.core", "hybridkv.demo_texts"},
    {"hybridkv.files", "hybridkv.layers", "hybridkv.kv_events", "hybridkv.plot", "hybridkv.tiers"},
    {"hybridkv.modeling", "hybridkv.tiny_models"},
    {"hybridkv.engine"},
    {"hybridkv.server", "hybridkv.integrations", "hybridkv.demo"},
    {"hybridkv.serving"},
    {"hybridkv.cli", "hybridkv"},
]


def package_graph() -> dict[str, set[str]]:
    """hybridkv.X -> the other hybridkv.Y its modules import."""
    def package(module):
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(package(module), set()).update(package(t) for t in targets)
    return {p: targets - {p} for p, targets in graph.items()}


def test_packages_import_only_floors_below():
    # Module cycles are caught above; this catches two packages that import
    # each other through different modules (the server and the Ray app once
    # did), and a package that climbs above its floor.
    graph = package_graph()
    assert find_cycle(graph) is None
    floor = {p: i for i, packages in enumerate(FLOORS) for p in packages}
    assert set(graph) == set(floor), "a package without a floor: add it to FLOORS and docs/architecture.md"
    climbs = {p: sorted(t for t in targets if floor[t] >= floor[p]) for p, targets in graph.items()}
    assert {p: t for p, t in climbs.items() if t} == {}


def test_the_package_checks_can_fail():
    graph = package_graph()
    floor = {p: i for i, packages in enumerate(FLOORS) for p in packages}
    graph["hybridkv.core"].add("hybridkv.kv_events")  # a climb, and with kv_events -> core a cycle
    assert any(floor[t] >= floor[p] for p, targets in graph.items() for t in targets)
    assert find_cycle(graph) is not None


def test_model_files_never_name_an_implementation():
    # Model files and the shared layers call the ops bound to them; which
    # backend runs them is chosen in layers/backends/ alone.
    graph = import_graph()
    shared = [m for m in graph if m.startswith(("hybridkv.modeling.", "hybridkv.layers."))
              and not m.startswith("hybridkv.layers.backends")]
    assert len(shared) > 10
    offenders = {m: sorted(t for t in graph[m] if t.startswith("hybridkv.layers.backends")) for m in shared}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_every_soak_case_names_a_test_that_exists():
    # conftest.py's SOAK_CASES move cases out of the main suite by name: a
    # renamed or deleted test must not leave an entry that moves nothing.
    from conftest import SOAK_CASES

    here = os.path.dirname(os.path.abspath(__file__))
    for case in SOAK_CASES:
        path, _, name = case.partition("::")
        function = name.split("[")[0]
        source = open(os.path.join(here, path)).read()
        assert re.search(rf"^def {re.escape(function)}\(", source, re.M), f"SOAK_CASES: {case} names no test"
        if "[" in name:  # a parameter: the test must still be parametrized with it
            param = name.split("[", 1)[1].rstrip("]").split("-")[0]
            assert param in source, f"SOAK_CASES: {case}: no parameter {param!r} in {path}"
