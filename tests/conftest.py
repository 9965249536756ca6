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


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for engine tests (cpu, cuda)")
    parser.addoption("--dtype", default="float32", help="engine dtype for oracle tests (float32, bfloat16)")


@pytest.fixture(scope="session")
def engine_device(request):
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def engine_dtype(request):
    return request.config.getoption("--dtype")
