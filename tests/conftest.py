# conftest.py: shared fixtures: force each ISA path in turn, and restore the default afterwards;
# one torch thread per xdist worker, and for the modules whose fake devices and CPU workers run threads of their own;
# dynamo's frame counter cleared after each test (see no_compiled_frames_after_the_test); optimizers
# closed after the test (opts); a filesystem that refuses O_DIRECT (no_o_direct); the configurations
# tests run over (Config, configs(): side x tier x moments x schedule) and make_opt, which builds
# one; patch_kernels, the kernel call of every bucket wrapped.
import dataclasses
import errno
import os
import pathlib
from typing import Optional

import pytest

# each xdist worker (and every process a test starts, which inherits this) runs torch with one intra-op
# thread: two workers on a 2-core machine each spinning two OpenMP threads slow a float64 reference
# loop several-fold; the kernels' own thread pool is sized separately (offload.kernels.set_num_threads)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 (after the thread setting above)

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
    wait for every upload in step() (offload/schedule/uploads.py compiled_code_in_use) in all later
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
    """The filesystem refuses O_DIRECT (as some do, with EINVAL) for every open through offload/native/aio.py."""
    from offload.native import aio
    real_open = os.open

    def no_direct(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kw)
    monkeypatch.setattr(aio.os, "open", no_direct)


# ---------------------------------------------------------------------------- configurations
# Where the parameters live (side) x where the state lives (tier) x moment format, and for device
# parameters when buckets are stepped (schedule). Tests parametrise over configs(...) instead of tables of
# their own; make_opt builds the optimizer of a Config and checks the fake device's hazards at teardown.
SIDES = ("host", "cpu", "fake")            # host parameters; offload.device.CpuDevice; FakeDevice
TIERS = ("ram", "nvme", "mmap")
MOMENTS = ("fp32", "bf16", "8bit")
SCHEDULES = ("eager", "deferred", "sync")  # device sides only (offload/optim/options.py OPTIONS_DOC)
_SCHEDULE_KW = {"eager": dict(overlap=True, step_during_backward=True),
                "deferred": dict(overlap=True, step_during_backward=False),
                "sync": dict(overlap=False)}


@dataclasses.dataclass(frozen=True)
class Config:
    side: str = "host"
    tier: str = "ram"
    moments: str = "fp32"
    schedule: Optional[str] = None   # None: host parameters, or the device default (eager, deferred with clipping)

    @property
    def device(self) -> bool:
        return self.side != "host"

    @property
    def id(self) -> str:
        return "-".join(v for v in (self.side, self.tier, self.moments, self.schedule) if v)

    @property
    def schedule_kw(self) -> dict:
        """The constructor options of this schedule (offload/optim/options.py): overlap, step_during_backward."""
        return dict(_SCHEDULE_KW.get(self.schedule, {}))

    def kwargs(self, tmp_path, **over) -> dict:
        """The optimizer's keywords for this configuration: a state directory under ``tmp_path`` with a small
        ``host_budget`` (state split over buckets), ``bucket_mb=0.01`` for device parameters (parameters split
        over buckets), compressed moments for every tensor; ``over`` replaces or adds keywords."""
        kw = {}
        if self.tier != "ram":
            d = pathlib.Path(tmp_path) / f"state-{self.id}"
            d.mkdir(parents=True, exist_ok=True)
            kw.update(storage=self.tier, nvme_dir=str(d), host_budget=64 * 1024)
        if self.moments != "fp32":
            kw.update(moments=self.moments, moments_min_size=0)
        if self.side == "cpu":
            from offload.device import CpuDevice
            kw.update(offload_device=CpuDevice())
        elif self.side == "fake":
            from offload.device import FakeDevice
            kw.update(offload_device=FakeDevice(max_delay=0.002, seed=0))
        if self.device:
            kw.update(bucket_mb=0.01, **self.schedule_kw)
        kw.update(over)
        return kw


def _rows(sides, tiers, moments, schedules):
    """Every valid configuration: a schedule for device sides only."""
    return [Config(s, t, m, (c if s != "host" else None))
            for s in sides for t in tiers for m in moments for c in (schedules if s != "host" else (None,))]


def _pairs_of(cfg):
    vals = [("side", cfg.side), ("tier", cfg.tier), ("moments", cfg.moments)]
    if cfg.schedule is not None:
        vals.append(("schedule", cfg.schedule))
    return {(a, b) for i, a in enumerate(vals) for b in vals[i + 1:]}


def configs(sides=SIDES, tiers=TIERS, moments=MOMENTS, schedules=("eager",), cover="pairs", include=(), marks=()):
    """pytest params over configurations (ids like "fake-nvme-8bit-eager"). ``cover="all"``: the product;
    ``"pairs"``: a few rows holding every pair of values (side-tier, tier-moments, ..., and each schedule with
    every device side, tier and moment format): the 9-row Latin square of ARCHITECTURE.md section 4 when one
    schedule is given, chosen greedily (most new pairs first, then product order) otherwise. Deterministic.
    ``include``: Configs (or tuples) that must be among the rows; ``cover="listed"``: those rows only (whole
    training runs of the framework tests); ``marks``: pytest marks for every row."""
    rows = _rows(sides, tiers, moments, schedules)
    include = [c if isinstance(c, Config) else Config(*c) for c in include]
    if not set(include) <= set(rows):
        raise ValueError(f"include={[c.id for c in include if c not in rows]}: outside the rows asked for")
    if cover == "pairs":
        need = set().union(*(_pairs_of(c) for c in rows))
        at = {name: {v: i for i, v in enumerate(vals)} for name, vals in
              (("side", sides), ("tier", tiers), ("moments", moments))}
        chosen = []

        def take(c):
            chosen.append(c)
            need.difference_update(_pairs_of(c))
        for c in include:
            take(c)
        for c in rows if not include else ():   # the Latin square (side + tier - moments = 0 mod 3), one schedule each
            if (at["side"][c.side] + at["tier"][c.tier] - at["moments"][c.moments]) % 3 == 0 and not any(
                    (o.side, o.tier, o.moments) == (c.side, c.tier, c.moments) for o in chosen):
                same = [o for o in rows if (o.side, o.tier, o.moments) == (c.side, c.tier, c.moments)]
                best = max(same, key=lambda o: len(need & _pairs_of(o)))
                if need & _pairs_of(best):
                    take(best)
        while need:   # then greedily: the first row with the most pairs not yet covered
            take(max(rows, key=lambda c: len(need & _pairs_of(c))))
        rows = [c for c in rows if c in chosen]
    elif cover == "listed":
        rows = include
    elif cover != "all":
        raise ValueError(f"cover={cover!r}: 'pairs', 'all' or 'listed'")
    return [pytest.param(c, id=c.id, marks=marks) for c in rows]


def patch_kernels(monkeypatch, wrap) -> None:
    """Replace the kernel entry of every moment format, the native call of the one bucket body
    (offload/engine/bucket.py), by ``wrap(real entry)``."""
    from offload.moments.format import FORMATS, moment_format
    for name in FORMATS:
        fmt = moment_format(name)
        monkeypatch.setattr(fmt, "kernel", wrap(fmt.kernel))


@pytest.fixture
def make_opt(tmp_path):
    """make_opt(cfg, params, **kw) -> ``offload.AdamW(params, **cfg.kwargs(tmp_path, **kw))``; at teardown
    every optimizer made is closed and every FakeDevice it drove is checked for hazards (FakeDevice.check)."""
    import offload
    from offload.device import FakeDevice
    made, devices = [], []

    def make(cfg, params, **kw):
        kwargs = cfg.kwargs(tmp_path, **kw)
        made.append(offload.AdamW(params, **kwargs))
        if isinstance(kwargs.get("offload_device"), FakeDevice):
            devices.append(kwargs["offload_device"])
        return made[-1]
    yield make
    for o in made:
        o.close()
    for d in devices:
        d.check()
