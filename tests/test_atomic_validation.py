"""test_atomic_validation.py: a step that raises a validation error changes nothing (parameters,
state, step counters, the pending clip coefficient), and training then continues bitwise as if the
failed call had never been made: settings changed after the first step, torch's fallback
parameters (float64, non-contiguous) next to native ones, several param groups."""
import pytest
import torch

import offload
from offload import testing
from atomic_util import assert_same, grads, snapshot, train


def _pair(n_groups=2, **kw):
    """Two identical optimizers over two identical parameter sets (one to fail, one reference)."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s)) for s in (5, 7, 3)]
        groups = [{"params": ps[:2]}, {"params": ps[2:]}] if n_groups == 2 else [{"params": ps}]
        out.append((ps, offload.AdamW(groups, lr=0.1, **kw)))
    return out


@pytest.mark.parametrize("n_groups", [1, 2])
def test_amsgrad_switched_on_after_the_first_step_changes_nothing(n_groups):
    (ps, opt), (ref, ropt) = _pair(n_groups)
    train(ps, opt, 0, 1)
    train(ref, ropt, 0, 1)
    opt.param_groups[-1]["amsgrad"] = True
    grads(ps, 1)
    before = snapshot(ps, opt)
    with pytest.raises(ValueError, match=r"amsgrad=True.*max_exp_avg_sq.*amsgrad=False"):
        opt.step()
    assert_same(snapshot(ps, opt), before)
    opt.param_groups[-1]["amsgrad"] = False     # the setting restored: as if the call had not been made
    opt.step()
    train(ps, opt, 2, 2)
    train(ref, ropt, 1, 3)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


def _mixed():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(4, dtype=torch.float64)),
          torch.nn.Parameter(torch.randn(4, 3).t()), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    return ps, offload.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.1)


BAD_FALLBACK_GRADS = {
    "sparse": lambda p: setattr(p, "grad", torch.randn(p.shape, dtype=p.dtype).to_sparse()),
    "grad .data of another shape": lambda p: setattr(p.grad, "data", torch.randn(p.numel() + 1, dtype=p.dtype)),
    "grad .data of another dtype": lambda p: setattr(p.grad, "data", torch.randn(p.shape, dtype=torch.float32)),
}


@pytest.mark.parametrize("kind", list(BAD_FALLBACK_GRADS))
def test_bad_gradient_of_a_fallback_parameter_changes_nothing(kind):
    # the native rows and the first fallback parameter come before the bad one in step order
    ps, opt = _mixed()
    train(ps, opt, 0, 1)
    grads(ps, 1)
    BAD_FALLBACK_GRADS[kind](ps[3])
    before = snapshot(ps, opt)
    with pytest.raises(RuntimeError, match="parameter 1 of group 1|sparse"):
        opt.step()
    assert_same(snapshot(ps, opt), before)


def test_bad_state_of_a_fallback_parameter_changes_nothing():
    ps, opt = _mixed()
    train(ps, opt, 0, 1)
    opt.state[ps[3]]["exp_avg"] = torch.zeros(5, dtype=torch.float64)
    grads(ps, 1)
    before = snapshot(ps, opt)
    with pytest.raises(ValueError, match="exp_avg"):
        opt.step()
    assert_same(snapshot(ps, opt), before)


def test_first_step_that_raises_leaves_no_state_behind():
    # state created for the rows validated before the error is taken back: state_dict() as before
    (ps, opt), (ref, ropt) = _pair(2)
    grads(ps, 0)
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    before = snapshot(ps, opt)
    with pytest.raises(ValueError, match="beta"):
        opt.step()
    assert_same(snapshot(ps, opt), before)
    assert len(opt.state) == 0
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    train(ps, opt, 0, 3)
    train(ref, ropt, 0, 3)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))


@pytest.mark.parametrize("mode", ["nvme", "mmap", "8bit"])
def test_amsgrad_switched_on_with_the_state_engine_changes_nothing(tmp_path, mode):
    kw = dict(moments="8bit", moments_min_size=4) if mode == "8bit" else dict(storage=mode, nvme_dir=tmp_path)
    (ps, opt), (ref, ropt) = _pair(2, **kw)
    train(ps, opt, 0, 1)
    train(ref, ropt, 0, 1)
    opt.param_groups[1]["amsgrad"] = True
    grads(ps, 1)
    before = snapshot(ps, opt)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    assert_same(snapshot(ps, opt), before)
    opt.param_groups[1]["amsgrad"] = False
    train(ps, opt, 1, 2)
    train(ref, ropt, 1, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))
    opt.close()
    ropt.close()


@pytest.mark.parametrize("mode", ["ram", "nvme", "8bit"])
def test_offload_load_recovers_a_failed_optimizer(tmp_path, monkeypatch, mode):
    # a step that failed part-way: refused until offload.load of the last checkpoint, then bitwise
    kw = (dict(moments="8bit", moments_min_size=4) if mode == "8bit" else
          dict(storage=mode, nvme_dir=tmp_path) if mode == "nvme" else {})
    (ps, opt), (ref, ropt) = _pair(2, **kw)
    train(ps, opt, 0, 2)
    train(ref, ropt, 0, 4)
    offload.save(opt, tmp_path / "ckpt")
    weights = [p.detach().clone() for p in ps]
    calls = [0]
    if testing.state_engine(opt) is None:
        real = offload.native.adam.step_table

        def second_group_fails(*a):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected")
            return real(*a)
        monkeypatch.setattr(offload.native.adam, "step_table", second_group_fails)
    else:
        real = testing.tier(opt).release

        def write_back_fails(*a):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected")
            return real(*a)
        monkeypatch.setattr(testing.tier(opt), "release", write_back_fails)
    grads(ps, 2)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    monkeypatch.undo()
    with pytest.raises(offload.OptimizerFailedError, match="load the last checkpoint"):
        opt.step()
    with pytest.raises(offload.OptimizerFailedError):
        offload.save(opt, tmp_path / "bad")
    with torch.no_grad():
        for p, w in zip(ps, weights):
            p.copy_(w)
    offload.load(opt, tmp_path / "ckpt")
    train(ps, opt, 2, 2)
    assert_same(snapshot(ps, opt), snapshot(ref, ropt))
    opt.close()
    ropt.close()
