"""test_optim_state_groups.py: param groups edited between steps, as torch.optim.AdamW allows:
a parameter moved to a new group (``params.pop()`` then ``add_param_group``, a per-layer lr)
keeps its state, with or without a step in between, for every tier, moment format and parameter
side; a parameter edited out of the lists before a backward that steps during backward is refused
by name there; amsgrad switched on, off and on again uses the kept ``max_exp_avg_sq`` as torch
does; a parameter given another size is named by state_dict(), offload.save and step(). The
reference is the documented way (a new optimizer with the new groups, given the state through
load_state_dict of its stored form: bitwise, compressed moments included) and, for fp32 moments,
torch.optim.AdamW.
"""
import pytest
import torch

import offload
from conftest import configs
from optim_state_util import LR, close
from test_optim_state_permute import _grads, _stored

EVERY = dict(sides=("host", "fake"), cover="all")


def _move(opt, lr=1e-3):
    p = opt.param_groups[0]["params"].pop()
    opt.add_param_group({"params": [p], "lr": lr})


class Moved:
    """Three parameters in one group; parameter 1 sits out the first step (a step count apart)."""

    def __init__(self, make_opt, cfg):
        self.cfg, self.make_opt = cfg, make_opt
        torch.manual_seed(0)
        self.ours = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(3)]
        self.twin = [torch.nn.Parameter(p.detach().clone()) for p in self.ours]
        self.ref = [torch.nn.Parameter(p.detach().clone()) for p in self.ours]
        self.opt, self.topt = make_opt(cfg, self.ours, lr=LR), make_opt(cfg, self.twin, lr=LR)
        self.torch = torch.optim.AdamW(self.ref, lr=LR)
        self.steps(0, only=(0, 2))
        self.steps(1, 2)

    def each(self):
        return ((self.ours, self.opt), (self.twin, self.topt), (self.ref, self.torch))

    def steps(self, *seeds, only=None):
        for s in seeds:
            for ps, o in self.each():
                _grads(ps, s, only)
                o.step()
        self.opt.synchronize()
        self.topt.synchronize()

    def twin_moved(self):
        """The documented way: a new optimizer with the new groups, given the stored state."""
        entries = _stored(self.topt, self.twin)
        self.topt.close()
        groups = [{"params": self.twin[:2]}, {"params": self.twin[2:], "lr": 1e-3}]
        self.topt = self.make_opt(self.cfg, groups, lr=LR)
        sd = self.topt.state_dict()
        sd["state"] = {k: entries[p] for k, p in enumerate(self.twin)}
        self.topt.load_state_dict(sd)

    def check(self):
        self.steps(5, 6)
        for a, b in zip(self.ours, self.twin):
            assert torch.equal(a, b)
            assert float(self.opt.state[a]["step"]) == float(self.topt.state[b]["step"])
        assert float(self.opt.state[self.ours[2]]["step"]) == 5.0
        if self.cfg.moments == "fp32":
            close(self.ours, self.ref)


@pytest.mark.parametrize("cfg", configs(**EVERY))
def test_parameter_moved_to_a_new_group_keeps_its_state(make_opt, cfg):
    run = Moved(make_opt, cfg)
    _move(run.opt)
    _move(run.torch)
    run.twin_moved()
    run.check()


@pytest.mark.parametrize("cfg", configs(**dict(EVERY, cover="pairs")))
def test_parameter_moved_with_a_step_in_between_keeps_its_state(make_opt, cfg):
    """Removed from its group, a step without it (torch keeps its opt.state entry), then added back
    in a group of its own: its next step goes on from that entry."""
    run = Moved(make_opt, cfg)
    for o in (run.opt, run.torch):
        o.param_groups[0]["params"].pop()
    for ps, o in run.each():   # (the twin's parameter 2 stays in its group, without a gradient)
        _grads(ps, 3, only=(0, 1))
        o.step()
    run.opt.synchronize()
    run.opt.add_param_group({"params": [run.ours[2]], "lr": 1e-3})
    run.torch.add_param_group({"params": [run.ref[2]], "lr": 1e-3})
    run.twin_moved()
    run.check()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", configs(sides=("fake",), schedules=("eager", "deferred", "sync")))
def test_device_groups_edited_between_steps_with_backward(make_opt, cfg):
    """A model trained with backward: a layer moved to a group of its own between steps keeps its
    state (bitwise the documented way); a params list edited before a backward that steps buckets
    during backward (the eager schedule) is refused by name there, changing nothing, and
    opt.synchronize() lays the state out again, after which training goes on as torch's does."""
    def model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))

    def train(m, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            m(torch.randn(8, 12, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if opt is not ot:
            opt.synchronize()

    a, b, t = model(), model(), model()
    oa, ob = make_opt(cfg, list(a.parameters()), lr=LR), make_opt(cfg, list(b.parameters()), lr=LR)
    ot = torch.optim.AdamW(t.parameters(), lr=LR)
    for m, o in ((a, oa), (b, ob), (t, ot)):
        train(m, o, 2, 0)
    _move(oa)   # the last bias moves to a group of its own
    _move(ot)
    entries, ps = _stored(ob, list(b.parameters())), list(b.parameters())
    ob.close()   # the documented way: a new optimizer with the new groups, given the stored state
    ob = make_opt(cfg, [{"params": ps[:3]}, {"params": ps[3:], "lr": 1e-3}], lr=LR)
    sd = ob.state_dict()
    sd["state"] = {k: entries[p] for k, p in enumerate(ps)}
    ob.load_state_dict(sd)
    for m, o in ((a, oa), (b, ob), (t, ot)):
        train(m, o, 2, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for o in (oa, ob, ot):   # the moved bias leaves the optimizer
        o.param_groups[1]["params"].pop()
    ob.synchronize()
    if cfg.schedule == "eager":   # (the others send gradients at step(): laid out again there)
        with pytest.raises(RuntimeError, match=r"'params' list or amsgrad changed since the last "
                                               r"step.*synchronize\(\)"):
            a(torch.randn(8, 12)).square().mean().backward()
        for p in a.parameters():
            p.grad = None
        oa.synchronize()
    for m, o in ((a, oa), (b, ob), (t, ot)):
        train(m, o, 2, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    if cfg.moments == "fp32":
        close(list(a.parameters()), list(t.parameters()))


@pytest.mark.parametrize("cfg", configs(sides=("host", "fake"), moments=("fp32",), cover="all"))
def test_amsgrad_on_off_on_follows_torch(make_opt, cfg):
    """torch keeps max_exp_avg_sq in opt.state while amsgrad is off and uses it again when switched
    back on."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = make_opt(cfg, ours, lr=LR, amsgrad=True)
    topt = torch.optim.AdamW(ref, lr=LR, amsgrad=True)
    for s, flag in enumerate([True, True, False, False, True, True]):
        for ps, o in ((ours, opt), (ref, topt)):
            o.param_groups[0]["amsgrad"] = flag
            _grads(ps, s)
            for p in ps:   # larger gradients early: the kept maximum matters later
                p.grad.mul_(4.0 if s < 2 else 1.0)
            o.step()
        opt.synchronize()
        close(ours, ref)
        assert set(opt.state[ours[0]]) == set(topt.state[ref[0]])
        torch.testing.assert_close(opt.state[ours[0]]["max_exp_avg_sq"],
                                   topt.state[ref[0]]["max_exp_avg_sq"])


@pytest.mark.parametrize("cfg", configs(**dict(EVERY, cover="pairs")))
def test_resized_parameter_is_named_by_state_dict_and_step(make_opt, cfg, tmp_path):
    """A parameter given another size (p.data = ...): state_dict(), offload.save and step() name it
    (group and index) and say what to do; given its size back, everything works again."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(3)]
    opt = make_opt(cfg, [{"params": ps[:1]}, {"params": ps[1:]}], lr=LR)
    _grads(ps, 0)
    opt.step()
    opt.synchronize()
    kept = ps[2].data
    ps[2].data = torch.randn(8, 5)
    want = (r"parameter 1 of group 1 has 40 elements, but its optimizer state was made for 30.*"
            r"give it back a tensor of 30 elements, or build a new optimizer")
    for call in (opt.state_dict, lambda: offload.save(opt, tmp_path / "ckpt"),
                 lambda: (_grads(ps, 1), opt.step())):
        with pytest.raises(RuntimeError, match=want):
            call()
    ps[2].data = kept
    _grads(ps, 2)
    opt.step()
    assert len(opt.state_dict()["state"]) == 3
