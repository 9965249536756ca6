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
    # The cpu backend's C kernels, built for this machine and the source as
    # it is now (an install builds them; an edited kernels.c needs a new
    # build, which the tests make here rather than skip or test a stale one).
    from hybridkv.layers.backends.cpu import build

    if build.built_library() is None and build.compiler() is not None:
        print(f"hybridkv: built the CPU kernels for this source: {build.build()}")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for engine tests (cpu, cuda)")
    parser.addoption("--dtype", default="float32", help="engine dtype for oracle tests (float32, bfloat16)")


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
