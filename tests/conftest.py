import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for engine tests (cpu, cuda)")
    parser.addoption("--dtype", default="float32", help="engine dtype for oracle tests (float32, bfloat16)")


@pytest.fixture(scope="session")
def engine_device(request):
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def engine_dtype(request):
    return request.config.getoption("--dtype")
