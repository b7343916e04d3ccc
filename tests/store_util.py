"""store_util.py: helpers of the NVMe/mmap state tests (test_store_*.py, test_nvme_drives.py): parameters
of several dtypes in three groups of different hyperparameters, steps with deterministic gradients (a
missing gradient, clipping), the bitwise comparison of parameters and state_dict, the in-RAM reference
run (a fixture) and a Python script run in a child process."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import offload


def make_params(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1000, generator=g), torch.randn(37, 5, generator=g).bfloat16(),
            torch.randn(4099, generator=g).half(), torch.randn(3, generator=g), torch.randn(0, generator=g),
            torch.randn(2500, generator=g).bfloat16(), torch.randn(7, 11, generator=g)]


def make_opt(ps, cls=offload.AdamW, **kw):
    groups = [{"params": ps[:2]},
              {"params": ps[2:5], "amsgrad": True, "lr": 1e-2, "weight_decay": 0.1},
              {"params": ps[5:], "maximize": True, "betas": (0.8, 0.9)}]
    return cls(groups, **kw)


def run_steps(ps, opt, steps, seed=100, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(seed + s)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if s % 3 == 2:
            ps[3].grad = None  # a parameter without gradient this step keeps its state and step count
        if s % 4 == 1:
            opt.clip_grad_norm_(0.5)  # folded into the next step's multiplier
        opt.step()


def assert_same(ps_a, sd_a, ps_b, sd_b):
    for a, b in zip(ps_a, ps_b):
        assert torch.equal(a, b)
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k, st in sd_a["state"].items():
        assert st.keys() == sd_b["state"][k].keys()
        for key, v in st.items():
            assert torch.equal(v, sd_b["state"][k][key]), (k, key)
    assert sd_a["param_groups"] == sd_b["param_groups"]


@pytest.fixture(scope="module")
def reference():
    ps = make_params()
    opt = make_opt(ps)
    run_steps(ps, opt, 12)
    return ps, opt.state_dict()


def _run_script(script, *args, timeout=60):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)
