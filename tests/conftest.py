import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, triton's kernels run under its interpreter; it is read when
# the kernels are decorated, so it is set before any test imports them.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def pytest_configure(config):
    # Engines built without a dtype run in `--dtype` (float32 unless asked):
    # the oracle's tolerances are float32's, and "auto" would pick bfloat16
    # on a CPU that computes it natively. Subprocesses (servers, ranks)
    # inherit it; tests of "auto" itself remove it.
    os.environ["HYBRIDKV_DTYPE"] = config.getoption("--dtype")
    # hybridkv's C libraries (the cpu backend's kernels, the block-key
    # chain), built for this machine and the sources as they are now (an
    # install builds them; an edited source needs a new build, which the
    # tests make here rather than skip or test a stale one).
    from hybridkv.core.native import LIBRARIES, compiler

    for library in LIBRARIES:
        if library.built_library() is None and compiler() is not None:
            print(f"hybridkv: built {library.source.name} for this source: {library.build()}")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for engine tests (cpu, cuda)")
    parser.addoption("--dtype", default="float32",
                     help="engine dtype for oracle tests and engines built without one (float32, bfloat16)")


@pytest.fixture(scope="session")
def engine_device(request):
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def engine_dtype(request):
    return request.config.getoption("--dtype")


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    # A tensor-parallel test that fails before closing its engine leaves this
    # process's torch.distributed group up, and every later one would fail
    # to start its own: end it here, so one failure stays one failure.
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Cases that duplicate what a faster case of the same test covers, moved to
# the soak run (`pytest -m soak`) to keep the main suite near 10 minutes on
# 2 cores: each keeps a sibling in the main suite (named after the #).
SOAK_CASES = (
    # the triton backend under the interpreter with drafts: jamba's rollback stays
    "test_speculative_engine.py::test_hybrid_speculative_triton_backend_matches_transformers[gemma3]",
    "test_speculative_engine.py::test_hybrid_speculative_triton_backend_matches_transformers[gpt_oss]",
    # triton+flashinfer engines on the fake FlashInfer: jamba stays
    "test_flashinfer_attention.py::test_an_engine_on_triton_plus_flashinfer_generates_what_the_kernels_generate[gemma3]",
    "test_flashinfer_attention.py::test_an_engine_on_triton_plus_flashinfer_generates_what_the_kernels_generate[gpt_oss]",
    # the triton backend at fixed shapes: the exact-decode cases stay
    "test_engine_oracle.py::test_hybrid_triton_backend_matches_transformers[fixed-decode-",
    # the real model on two ranks: the tiny families' TP tests and the TP benchmark's quick run stay
    "test_tensor_parallel.py::test_the_real_gemma3_270m_on_two_ranks",
    # replicas with TP: replicas with tiers, and TP alone, stay
    "test_ray_replicas.py::test_replicas_with_tensor_parallelism_equal_one_plain_engine",
    # Gemma-3 on two ranks with preemption, then with drafts: Jamba's two ranks with rejected drafts and
    # preemption in one run (test_tensor_parallel_combined.py) and Gemma-3's other two-rank tests stay
    "test_tensor_parallel.py::test_preemption_and_speculative_decoding_on_two_ranks",
    # two ranks' disk tier with a host tier above it: the disk tier alone stays
    "test_tensor_parallel_combined.py::test_two_ranks_with_a_disk_tier_serve_hits_from_disk_after_a_restart_"
    "with_the_one_process_tokens[64KiB]",
    # two ranks through the C decoder layers: gemma3 stays
    "test_tensor_parallel_layers.py::test_two_ranks_take_the_one_process_route_through_the_c_decoder_layers[mistral]",
    "test_tensor_parallel_layers.py::test_two_ranks_take_the_one_process_route_through_the_c_decoder_layers[gemma2]",
    # the Triton kernels' engine against the reference backend: jamba stays, and gemma3 on the triton
    # backend against transformers (test_engine_oracle.py) stays
    "test_triton_kernels.py::test_engine_with_triton_kernels_generates_the_reference_tokens[gemma3]",
    # the real model's drafts and disk restart: the tiny models' speculative and disk-tier tests stay
    "test_real_gemma3.py::test_hybrid_real_gemma3_speculative_decoding_keeps_greedy_tokens",
    "test_real_gemma3.py::test_hybrid_real_gemma3_disk_tier_hit_after_a_restart_matches_transformers",
    # prefill/decode replicas measured: their test in test_ray_replicas.py stays
    "test_benchmarks.py::test_disaggregated_quick",
    # the real model's prefill and decode engines: the four tiny families' (test_disaggregated.py) stay
    "test_real_gemma3.py::test_hybrid_real_gemma3_prefill_and_decode_engines_match_transformers",
    # Jamba on two ranks with drafts: its rejected drafts and preemption on two ranks
    # (test_tensor_parallel_combined.py) and its rank's slices (test_tensor_parallel_layers.py) stay
    "test_tensor_parallel.py::test_jamba_splits_its_mamba_channels_and_experts_over_two_ranks",
    # every family on two ranks: one per mixer kind stays (Nemotron-H and Bamba with one group: Mamba-2
    # with latent experts and a group shared by the ranks; Qwen3-Next: Gated DeltaNet; gpt-oss: sinks and
    # stacked experts; LFM2's channel split is the one Jamba's Mamba layers make)
    "test_tensor_parallel_families.py::test_every_family_on_two_ranks_gives_the_one_process_tokens_and_logits[granite_hybrid]",
    "test_tensor_parallel_families.py::test_every_family_on_two_ranks_gives_the_one_process_tokens_and_logits[bamba]",
    "test_tensor_parallel_families.py::test_every_family_on_two_ranks_gives_the_one_process_tokens_and_logits[falcon_h1]",
    "test_tensor_parallel_families.py::test_every_family_on_two_ranks_gives_the_one_process_tokens_and_logits[qwen3_5]",
    "test_tensor_parallel_families.py::test_every_family_on_two_ranks_gives_the_one_process_tokens_and_logits[lfm2]",
    # the real model's benchmarks, their quick runs: the real model's engine tests (test_real_gemma3.py)
    # and the tiny models' benchmark runs (engine_throughput, step_times, tensor_parallel) stay
    "test_benchmarks.py::test_real_gemma3_quick",
    "test_benchmarks.py::test_cpu_decode_step_quick",
    # the Triton kernels' engine on float8 pages: int8 stays (the same kernels, and the conformance
    # suite and the self-test hold float8's codes and attention)
    "test_triton_kernels.py::test_the_kernels_on_quantized_pages_give_the_references_tokens[fp8_e4m3]",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(case in item.nodeid for case in SOAK_CASES):
            item.add_marker(pytest.mark.soak)
