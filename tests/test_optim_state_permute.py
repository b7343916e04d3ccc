"""test_optim_state_permute.py: whole opt.state entries or single state tensors moved between
parameters (swapped, rotated, a view of another entry's memory), as when experts or heads are
permuted, and entries given to parameters without state yet: the result is torch's, for every tier,
moment format and parameter side (host; device through the FakeDevice).

The reference of each case is the same optimizer given the permuted state through
load_state_dict of its stored form (bitwise, compressed moments included) and, for fp32 moments,
torch.optim.AdamW doing the same. What torch would share between parameters (one tensor in two
entries) is refused by name, changing nothing.
"""
import pytest
import torch

from offload import testing
from conftest import Config, configs
from optim_state_util import LR, close

EVERY = dict(sides=("host", "fake"), cover="all")
FP32 = dict(sides=("host", "fake"), moments=("fp32",), cover="all")


def _grads(ps, seed, only=None, positive=False):
    gen = torch.Generator().manual_seed(seed)
    for k, p in enumerate(ps):
        g = torch.randn(p.shape, generator=gen)
        g = g.abs() + 0.1 if positive else g
        p.grad = None if only is not None and k not in only else g.to(p.dtype)


def _stored(opt, params) -> dict:
    """{parameter: its stored state}: copies of step, fp32, compressed tensors ({}: none)."""
    def stored(p):
        return dict(step=opt.state[p]["step"].clone(),
                    **{k: t.clone() for k, t in testing.raw_state(opt, p).items()})
    return {p: stored(p) if opt.state.get(p) else {} for p in params}


def _load(opt, params, entries: dict) -> None:
    sd = opt.state_dict()
    for k, p in enumerate(params):
        sd["state"][k] = entries[p]
        if not entries[p]:
            del sd["state"][k]
    opt.load_state_dict(sd)


class Run:
    """``ours`` (the permutation through opt.state), ``twin`` (the same through load_state_dict)
    and, for fp32 moments, ``ref`` (torch), trained alike; parameter 0 is two steps ahead of the
    others (of those in ``active``: the others have no state yet)."""

    def __init__(self, make_opt, cfg, shapes, positive=False, active=None):
        self.cfg, self.positive = cfg, positive
        torch.manual_seed(0)
        self.ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        self.twin = [torch.nn.Parameter(p.detach().clone()) for p in self.ours]
        self.ref = [torch.nn.Parameter(p.detach().clone()) for p in self.ours]
        self.opt, self.topt = make_opt(cfg, self.ours, lr=LR), make_opt(cfg, self.twin, lr=LR)
        self.torch = torch.optim.AdamW(self.ref, lr=LR)
        self.steps(0, 1, only=(0,))
        self.steps(2, 3, only=active)

    def steps(self, *seeds, only=None):
        for s in seeds:
            for ps, o in ((self.ours, self.opt), (self.twin, self.topt), (self.ref, self.torch)):
                _grads(ps, s, only, self.positive)
                o.step()
        self.opt.synchronize()
        self.topt.synchronize()

    def permute(self, edit) -> None:
        """``edit(state, params)`` on opt.state (ours), the stored form (twin), torch's state."""
        entries = _stored(self.topt, self.twin)
        edit(entries, self.twin)
        _load(self.topt, self.twin, entries)
        edit(self.opt.state, self.ours)
        edit(self.torch.state, self.ref)

    def check(self) -> None:
        self.steps(4, 5)
        for a, b in zip(self.ours, self.twin):
            assert torch.equal(a, b)
            assert float(self.opt.state[a]["step"]) == float(self.topt.state[b]["step"])
        if self.cfg.moments == "fp32":
            close(self.ours, self.ref)
            for a, r in zip(self.ours, self.ref):
                assert float(self.opt.state[a]["step"]) == float(self.torch.state[r]["step"])
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(self.opt.state[a][key], self.torch.state[r][key])


def swap(S, p):
    S[p[0]], S[p[1]] = S[p[1]], S[p[0]]


def rotate(S, p):
    S[p[0]], S[p[1]], S[p[2]] = S[p[1]], S[p[2]], S[p[0]]


def swap_keys(S, p):
    st = S[p[0]]
    st["exp_avg"], st["exp_avg_sq"] = st["exp_avg_sq"], st["exp_avg"]


def cross_keys(S, p):   # a cycle through both keys of two parameters
    a, b = S[p[0]], S[p[1]]
    a["exp_avg"], a["exp_avg_sq"], b["exp_avg"], b["exp_avg_sq"] = \
        b["exp_avg_sq"], a["exp_avg"], a["exp_avg_sq"], b["exp_avg"]


def transposed(S, p):   # square parameters: each takes the transposed view of the other's memory
    a, b = S[p[0]], S[p[1]]
    a["exp_avg"], b["exp_avg"] = b["exp_avg"].t(), a["exp_avg"].t()


@pytest.mark.parametrize("edit", [swap, rotate], ids=["swap", "rotate"])
@pytest.mark.parametrize("cfg", configs(**EVERY))
def test_whole_entries_permuted_like_torch(make_opt, cfg, edit):
    run = Run(make_opt, cfg, [(6, 5)] * 3)
    run.permute(edit)
    run.check()


@pytest.mark.parametrize("edit", [swap_keys, cross_keys, transposed],
                         ids=["swap_keys", "cross_keys", "transposed"])
@pytest.mark.parametrize("cfg", configs(**FP32))
def test_state_tensors_permuted_like_torch(make_opt, cfg, edit):
    run = Run(make_opt, cfg, [(5, 5)] * 3, positive=True)   # exp_avg > 0: a valid exp_avg_sq
    run.permute(edit)
    run.check()


@pytest.mark.parametrize("cfg", configs(**FP32))
def test_part_of_another_entry_like_torch(make_opt, cfg):
    """A parameter takes a view of part of a bigger one's moment, which takes a new tensor."""
    def edit(S, p):
        S[p[1]]["exp_avg"], S[p[0]]["exp_avg"] = S[p[0]]["exp_avg"][2:], torch.full((6, 5), 0.01)
    run = Run(make_opt, cfg, [(6, 5), (4, 5)])
    run.permute(edit)
    run.check()


@pytest.mark.parametrize("cfg", configs(**dict(EVERY, cover="pairs")))
def test_compressed_entry_replaced_by_a_plain_dict_is_encoded(make_opt, cfg):
    """A new dict of fp32 moments in place of an entry: taken as load_state_dict would take it."""
    def edit(S, p):
        S[p[1]] = {"step": torch.tensor(7.0), "exp_avg": torch.full(p[1].shape, 0.02),
                   "exp_avg_sq": torch.full(p[1].shape, 3e-3)}
    run = Run(make_opt, cfg, [(6, 5)] * 2)
    run.permute(edit)
    run.check()


@pytest.mark.parametrize("cfg", configs(**dict(EVERY, cover="pairs")))
def test_state_shared_by_two_parameters_is_refused(make_opt, cfg):
    """torch would update one tensor once per parameter holding it: refused by name, no change."""
    run = Run(make_opt, cfg, [(6, 5)] * 3)
    S, ps = run.opt.state, run.ours
    before = {p: {k: t.clone() for k, t in testing.raw_state(run.opt, p).items()} for p in ps}
    steps = [float(S[p]["step"]) for p in ps]
    saved = {p: (S[p], S[p].plain() if cfg.moments != "fp32" else dict(S[p])) for p in ps}
    cases = [lambda: S.__setitem__(ps[0], S[ps[1]]), lambda: S.__setitem__(ps[2], S[ps[1]])]
    if cfg.moments == "fp32":
        cases += [lambda: S[ps[0]].__setitem__("exp_avg", S[ps[1]]["exp_avg_sq"]),
                  lambda: S[ps[0]].__setitem__("exp_avg", S[ps[1]]["exp_avg"][:, :]),
                  lambda: [S[q].__setitem__("exp_avg", S[ps[2]]["exp_avg"]) for q in ps[:2]]]
    cases.append(lambda: [S[q].__setitem__("step", S[ps[2]]["step"]) for q in ps[:2]])
    for case in cases:
        case()
        with pytest.raises(ValueError, match=r"of group 0 .*the same memory as .* of group 0"):
            run.opt.step()
        for p in ps:
            S[p], entries = saved[p]
            inner = S[p].live if cfg.moments != "fp32" else S[p]
            inner.clear()
            inner.update(entries)
            for k, t in testing.raw_state(run.opt, p).items():
                assert torch.equal(t, before[p][k]), k
        assert [float(S[p]["step"]) for p in ps] == steps
    run.check()


def test_swap_with_one_parameter_stepped_in_between(make_opt):
    """Each entry is read before any is written: the step counts go with the moments."""
    cfg = Config()
    run = Run(make_opt, cfg, [(6, 5)] * 2)
    run.permute(swap)
    run.steps(7, only=(1,))
    run.permute(swap)
    run.check()


@pytest.mark.parametrize("cfg", configs(**dict(EVERY, cover="pairs")))
def test_entry_given_to_a_parameter_without_state_is_its_state(make_opt, cfg):
    """A stepped parameter's entry swapped with the empty one of a parameter never stepped yet, and
    a new entry given to one before its first step: as in torch, their next steps go on from it."""
    def given(S, p):
        S[p[2]] = {"step": torch.tensor(3.0), "exp_avg": torch.full(p[2].shape, 0.01),
                   "exp_avg_sq": torch.full(p[2].shape, 2e-3)}
    run = Run(make_opt, cfg, [(6, 5)] * 4, active=(0, 3))   # parameters 1 and 2: no state yet
    run.permute(swap)   # parameter 0 has no state now; parameter 1 holds what was 0's
    run.permute(given)
    run.check()


@pytest.mark.parametrize("cfg", configs(**dict(EVERY, cover="pairs")))
def test_entry_given_to_a_parameter_frozen_at_construction_is_its_state(make_opt, cfg):
    """The same for a parameter that had requires_grad=False when the optimizer was made (its state
    is laid out at its first gradient): bitwise what a parameter laid out from the start does."""
    runs = []
    for frozen in (True, False):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(2)]
        ps[1].requires_grad_(not frozen)
        opt = make_opt(cfg, ps, lr=LR)
        for s in range(2):
            _grads(ps, s, only=(0,))
            opt.step()
        ps[1].requires_grad_(True)
        opt.synchronize()
        opt.state[ps[1]] = {"step": torch.tensor(3.0), "exp_avg": torch.full((6, 5), 0.01),
                            "exp_avg_sq": torch.full((6, 5), 2e-3)}
        for s in range(2, 4):
            _grads(ps, s)
            opt.step()
        opt.synchronize()
        runs.append((ps, opt))
    (a, oa), (b, ob) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert float(oa.state[a[1]]["step"]) == float(ob.state[b[1]]["step"]) == 5.0
