# conftest.py: shared fixtures: force each ISA path in turn, and restore the default afterwards.
import pytest
import torch

from offload import kernels

ISAS = kernels.available_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    prev = kernels.get_isa()
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(prev)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
