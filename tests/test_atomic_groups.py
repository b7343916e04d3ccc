"""test_atomic_groups.py: add_param_group and load_state_dict that fail part-way (docs/failures.md):
either nothing changed (param groups, state_dict() bitwise, and training then continues exactly as a
run that never made the call), or the optimizer refuses with OptimizerFailedError until a load,
after which training continues exactly as an uninterrupted run. Host and device parameters (the CPU
test device, synchronous schedule), ram/nvme/mmap state, fp32 and 8-bit moments."""
import copy
import errno

import pytest
import torch

import offload
from offload import testing
from offload.device import CpuDevice
from atomic_util import assert_same, snapshot, train
from conftest import configs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROWS = dict(sides=("host", "cpu"), moments=("fp32", "8bit"), schedules=("sync",), cover="all")   # configs(...) here


def build(cfg, d):
    """Host parameters, or on the CPU test device with the synchronous schedule (cfg.side "cpu")."""
    tier, moments, device = cfg.tier, cfg.moments, cfg.device
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in (300, 50)]
    kw = dict(moments=moments, moments_min_size=100) if moments != "fp32" else {}
    if tier != "ram":
        kw.update(storage=tier, nvme_dir=d, host_budget=65536)
    if device:
        kw.update(offload_device=CpuDevice(), overlap=False, bucket_mb=0.002)
    return ps, offload.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.1}], lr=0.01, **kw)


def _pair(cfg, tmp_path, opts):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (ps, opt), (ref, ropt) = build(cfg, tmp_path / "a"), build(cfg, tmp_path / "b")
    opts += [opt, ropt]
    train(ps, opt, 0, 2)
    train(ref, ropt, 0, 2)
    return ps, opt, ref, ropt


def _refused_until_loaded(calls, sd, ps, opt, ref, ropt):
    """Each call refuses with OptimizerFailedError; after loading ``sd`` training continues as ``ropt``'s."""
    for call in calls:
        with pytest.raises(offload.OptimizerFailedError, match="injected.*load the last checkpoint"):
            call()
    opt.load_state_dict(sd)
    train(ps, opt, 2, 2)
    train(ref, ropt, 2, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


def _no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


@pytest.mark.parametrize("cfg", configs(**ROWS))
def test_add_param_group_that_cannot_grow_the_state_changes_nothing(cfg, tmp_path, opts, monkeypatch):
    # the tier cannot grow for the new group (a full disk, no memory): the group is not added
    ps, opt, ref, ropt = _pair(cfg, tmp_path, opts)
    before = snapshot(ps, opt)
    monkeypatch.setattr(testing.tier(opt), "allocate", _no_space)
    with pytest.raises(OSError, match="injected"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(200))]})
    monkeypatch.undo()
    assert len(opt.param_groups) == 2
    assert_same(snapshot(ps, opt), before)
    train(ps, opt, 2, 2)
    train(ref, ropt, 2, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))
    for o in (opt, ropt):   # and a group added afterwards works as in the other run
        torch.manual_seed(1)
        o.add_param_group({"params": [torch.nn.Parameter(torch.randn(200))]})
    train(ps + opt.param_groups[2]["params"], opt, 4, 1)
    train(ref + ropt.param_groups[2]["params"], ropt, 4, 1)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


@pytest.mark.parametrize("cfg", configs(**dict(ROWS, sides=("cpu",))))
def test_add_param_group_failing_after_the_state_grew_fails_the_optimizer(cfg, tmp_path, opts, monkeypatch):
    # the device staging cannot grow once the tier did: refused until a load, then bitwise as the other run
    ps, opt, ref, ropt = _pair(cfg, tmp_path, opts)
    sd = copy.deepcopy(opt.state_dict())
    monkeypatch.setattr(testing.side(opt), "allocate", _no_space)
    with pytest.raises(OSError, match="injected"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(200))]})
    monkeypatch.undo()
    assert len(opt.param_groups) == 2
    _refused_until_loaded((opt.step, opt.state_dict,
                           lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})),
                          sd, ps, opt, ref, ropt)
    for o in (opt, ropt):   # a group laid out where the dropped one was (other sizes): its own bytes
        torch.manual_seed(1)
        o.add_param_group({"params": [torch.nn.Parameter(torch.randn(n)) for n in (900, 40, 700)]})
    train(ps + opt.param_groups[2]["params"], opt, 4, 2)
    train(ref + ropt.param_groups[2]["params"], ropt, 4, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


BAD_ENTRIES = {   # found after the entries of group 0 were read
    "moment of another size": lambda st: st[1].__setitem__("exp_avg", torch.zeros(51)),
    "no exp_avg_sq": lambda st: [st[1].pop(k) for k in list(st[1]) if k.startswith("exp_avg_sq")],
}


@pytest.mark.parametrize("cfg", configs(**ROWS))
@pytest.mark.parametrize("bad", list(BAD_ENTRIES))
def test_load_state_dict_with_a_bad_entry_changes_nothing(cfg, bad, tmp_path, opts):
    ps, opt, ref, ropt = _pair(cfg, tmp_path, opts)
    sd = ropt.state_dict()
    sd = dict(sd, state=copy.deepcopy(sd["state"]))
    BAD_ENTRIES[bad](sd["state"])
    before = snapshot(ps, opt)
    with pytest.raises((ValueError, KeyError)):
        opt.load_state_dict(sd)
    assert_same(snapshot(ps, opt), before)
    train(ps, opt, 2, 2)
    train(ref, ropt, 2, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


@pytest.mark.parametrize("cfg", [c for c in configs(**ROWS) if (c.values[0].tier, c.values[0].moments)
                                 != ("ram", "fp32")])
def test_load_state_dict_failing_while_writing_the_state_fails_the_optimizer(cfg, tmp_path, opts, monkeypatch):
    ps, opt, ref, ropt = _pair(cfg, tmp_path, opts)
    sd = copy.deepcopy(opt.state_dict())
    real, calls = testing.tier(opt).write, [0]

    def second_write_fails(*a):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(*a)
    monkeypatch.setattr(testing.tier(opt), "write", second_write_fails)
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(sd)
    monkeypatch.undo()
    _refused_until_loaded((opt.step, opt.state_dict), sd, ps, opt, ref, ropt)
