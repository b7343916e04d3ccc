"""optim_state_util.py: helpers of the tests of what a user can change between steps
(test_optim_state_grads.py, test_optim_state_params.py, test_optim_state_tensors.py): the configurations
they run over, the make fixture (an offload.AdamW of a configuration), parameters with their torch
copies, deterministic gradients (and a step of both sides with them) and the comparison with torch; the child process of the crash-prone
cases."""
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import Config

HOST_FP32 = dict(sides=("host",), moments=("fp32",))   # configs(...) of this file: the tiers vary

LR = 1e-2


@pytest.fixture
def make(make_opt):
    """make(params, cfg, **kw) -> make_opt's offload.AdamW of that configuration (host RAM by default)."""
    return lambda params, cfg=Config(), **kw: make_opt(cfg, params, **dict(dict(lr=LR), **kw))


def pair(shape=(6, 5), dtype=torch.float32, seed=0, n=1):
    """n parameters for offload and a torch copy of each (fp32)."""
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for _ in range(n)]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    return ours, ref


def set_grads(ps, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def step_both(opt, topt, ours, ref, seed):
    """The same gradients (set_grads(..., seed)) on both sides, then a step of each optimizer."""
    set_grads(ours, seed)
    set_grads(ref, seed)
    opt.step()
    topt.step()


def close(a, b, **kw):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), **kw)


# crash-prone cases run in a child process: before the fixes they wrote or read freed memory
CHILD = textwrap.dedent("""
    import sys, torch, offload
    from collections import defaultdict
    case = sys.argv[1]
    ps = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, topt = offload.AdamW(ps, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    def grads(s):  # new gradients at first, then written in place (as zero_grad(set_to_none=False) does)
        for a, b in zip(ps, ref):
            g = torch.randn(a.shape, generator=torch.Generator().manual_seed(s))
            if a.grad is None or s == 0:
                a.grad, b.grad = g.clone(), g.clone()
            else:
                a.grad.copy_(g)
                b.grad.copy_(g)
    grads(0); opt.step(); topt.step()
    if case == "param_storage":
        ps[0].untyped_storage().resize_(16)
    elif case == "grad_storage":
        grads(1); ps[0].grad.untyped_storage().resize_(16)
    if case in ("param_storage", "grad_storage"):
        grads(1) if case == "param_storage" else None
        try:
            opt.step()
        except RuntimeError as e:
            assert "storage" in str(e), e
            print("REFUSED"); sys.exit(0)
        print("STEPPED"); sys.exit(1)
    for o, t in ((opt, ps), (topt, ref)):
        if case == "clear":
            o.state.clear()
        elif case == "new_dict":
            o.state = defaultdict(dict)
        elif case == "del":
            del o.state[t[1]]
        elif case == "empty":
            o.state[t[2]] = {}
        elif case == "replace_all":
            for p in t:
                o.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
    import gc; gc.collect()
    for s in range(1, 4):
        grads(s); opt.step(); topt.step()
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a.detach(), b.detach())
    print("OK")
""")


def _run_child(case):
    return subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=120)
