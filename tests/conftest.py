# conftest.py: shared fixtures: force each ISA path in turn, and restore the default afterwards;
# one torch thread for the modules whose fake devices and CPU workers run threads of their own;
# dynamo's frame counter cleared after each test (see no_compiled_frames_after_the_test); optimizers
# closed after the test (opts); a filesystem that refuses O_DIRECT (no_o_direct).
import errno
import os

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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``: the fake device's stream
    threads and the CPU worker run beside the "compute stream" (the test's thread); torch's spinning
    intra-op threads would oversubscribe a small machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_compiled_frames_after_the_test():
    """A test that ran torch.compile leaves dynamo's frame counter set, and device parameters then
    wait for every upload in step() (offload/step/uploads.py compiled_code_in_use) in all later
    tests of the process: clear it, so that the overlapped paths stay tested after such a test."""
    yield
    import sys
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:
        utils.counters.clear()


@pytest.fixture
def opts():
    """A list the test appends its optimizers to: each is closed afterwards."""
    made = []
    yield made
    for o in made:
        o.close()


@pytest.fixture
def no_o_direct(monkeypatch):
    """The filesystem refuses O_DIRECT (as some do, with EINVAL) for every open through offload/aio.py."""
    from offload import aio
    real_open = os.open

    def no_direct(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kw)
    monkeypatch.setattr(aio.os, "open", no_direct)
