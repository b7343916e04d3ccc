# test_resident.py: the parameters whose Adam state stays on the GPU (offload/schedule/resident.py), on
# the CPU: ResidentAdam is torch's fused AdamW over fp32 masters (bitwise against the same written out),
# keeps the gradients as backward left them, takes the user's writes into bf16 parameters, shows its
# state in offload's layout and loads it back; choose() keeps the fewest trailing buckets that end the
# CPU's part inside backward, within the budget.
import pytest
import torch

from offload.engine.port import StepPort
from offload.base.overlap import choose
from offload.schedule.resident import ResidentAdam, resident_bytes


def _port(groups, state):
    return StepPort(groups=lambda: groups, state=lambda: state, hyper=None, threads=lambda: 1,
                    pending=lambda: 1.0, set_pending=None, amp=lambda: (None, None))


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in ((7, 5), (13,))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_steps_are_torchs_fused_adamw_over_fp32_masters(dtype, decoupled):
    params = _params(dtype)
    groups = [{"params": params, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1,
               "amsgrad": False, "maximize": False}]
    state = {}
    res = ResidentAdam(_port(groups, state), {0: params}, decoupled)
    masters = [p.detach().float().clone().requires_grad_(False) for p in params]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls([dict(groups[0], params=masters)], foreach=True)
    for s, mult in enumerate((1.0, 0.5, 1.0)):
        _grads(params, s)
        before = [p.grad.clone() for p in params]
        for m, p in zip(masters, params):
            m.grad = p.grad.float() * mult if mult != 1.0 else p.grad.float()
        if s == 2:
            groups[0]["lr"] = 3e-3   # read from the outer group at every step
            ref.param_groups[0]["lr"] = 3e-3
        ref.step()
        res.step(mult)
        for p, g in zip(params, before):
            assert torch.equal(p.grad, g)   # the gradient backward left is not scaled in place
        for p, m in zip(params, masters):
            assert torch.equal(p.detach(), m.to(dtype))
    for p, m in zip(params, masters):
        st = state[p]
        assert torch.equal(st["exp_avg"], ref.state[m]["exp_avg"]) and float(st["step"]) == 3
        assert ("master_param" in st) == (dtype == torch.bfloat16)
        if dtype == torch.bfloat16:
            assert torch.equal(st["master_param"], m)


def test_user_writes_into_bf16_parameters_reach_the_master():
    params = _params(torch.bfloat16)
    groups = [{"params": params, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "maximize": False}]
    state = {}
    res = ResidentAdam(_port(groups, state), {0: params}, True)
    _grads(params, 0)
    res.step(1.0)
    before = state[params[0]]["master_param"].clone()
    assert not torch.equal(before, before.bfloat16().float())   # fp32 bits a bf16 weight does not hold
    with torch.no_grad():
        params[0].data[0, :2] = torch.tensor([3.0, -2.0])   # a write through .data: no version counter
    res.adopt_writes()
    m = state[params[0]]["master_param"]
    assert m[0, :2].tolist() == [3.0, -2.0]
    assert torch.equal(m[0, 2:], before[0, 2:]) and torch.equal(m[1:], before[1:])   # the rest: its fp32 bits
    assert torch.equal(params[0].detach(), m.bfloat16())


def test_loaded_state_goes_back_to_the_masters():
    params = _params(torch.bfloat16)
    groups = [{"params": params, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "maximize": False}]
    state = {}
    res = ResidentAdam(_port(groups, state), {0: params}, True)
    for s in range(2):
        _grads(params, s)
        res.step(1.0)
    saved = {p: {k: v.clone() for k, v in state[p].items()} for p in params}
    _grads(params, 2)
    res.step(1.0)
    after = [p.detach().clone() for p in params]
    # load the state after step 2 (as load_state_dict puts it into opt.state), and the weights then
    with torch.no_grad():
        for p in params:
            p.copy_(saved[p]["master_param"].bfloat16())
            state[p] = {k: v.clone() for k, v in saved[p].items()}
    res.load()
    _grads(params, 2)
    res.step(1.0)
    for p, a in zip(params, after):
        assert torch.equal(p.detach(), a)


def test_resident_bytes():
    assert resident_bytes(torch.zeros(10, dtype=torch.bfloat16)) == 160
    assert resident_bytes(torch.zeros(10)) == 120


def test_choose_keeps_the_fewest_trailing_buckets_that_hide_the_cpu_step():
    # 4 buckets of 1 s CPU each, arriving at 0, 1, 2, 3 s of a 3 s backward: the CPU ends at 4 s with all
    # of them, at 3 s without the last one
    sizes, arrive, cpu = [10] * 4, [0.0, 1.0, 2.0, 3.0], [1.0] * 4
    assert choose(sizes, arrive, cpu, 3.0, [100] * 4, budget=10 ** 9) == 1
    assert choose(sizes, arrive, cpu, 10.0, [100] * 4, budget=10 ** 9) == 0   # hidden already
    # a slow CPU: 2 s per bucket, the CPU must be left with the first bucket only (ends at 2 s <= 3 s)
    assert choose(sizes, arrive, [2.0] * 4, 3.0, [100] * 4, budget=10 ** 9) == 3
    # the budget holds two buckets: as many as fit, never more
    assert choose(sizes, arrive, [2.0] * 4, 3.0, [100] * 4, budget=250) == 2
    assert choose(sizes, arrive, [2.0] * 4, 3.0, [100] * 4, budget=0) == 0
