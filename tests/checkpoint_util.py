"""checkpoint_util.py: helpers of the offload.save / offload.load tests (test_checkpoint_*.py): a small
model with a low-precision group and its optimizer, deterministic training steps, state comparison, the
data file of a checkpoint, the NVMe/mmap/GPU-engine optimizer options, a snapshot of an optimizer and
the check that a refused load left it unchanged, and a saved checkpoint beside a second optimizer."""
import copy
import os

import torch

import offload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def make(seed=0, hidden=16, amsgrad=True, cls=offload.AdamW):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))
    model[2].to(torch.bfloat16)  # a low-precision group: state includes the fp32 master copy
    opt = cls([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
              lr=1e-2, amsgrad=amsgrad)
    return model, opt


def train(model, opt, steps, start):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randn(5, 8, generator=g)
        h = model[1](model[0](x))
        loss = model[2](h.to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        if isinstance(opt, offload.AdamW):
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def state_equal(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for kk in sa[k]:
            assert torch.equal(sa[k][kk], sb[k][kk]), (k, kk)


def data_file(d):
    return os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".safetensors")))


def _mode_kwargs(mode, tmp_path):
    if mode == "gpu-fake":  # GPU-offload engine driven on the CPU (offload/device.py)
        from offload.device import CpuDevice
        return {"offload_device": CpuDevice()}
    os.makedirs(tmp_path, exist_ok=True)
    return {"storage": mode, "nvme_dir": str(tmp_path), "host_budget": 16384}


def snapshot(opt):
    sd = opt.state_dict()
    state = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else copy.deepcopy(vv)) for kk, vv in v.items()}
             for k, v in sd["state"].items()}
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return state, copy.deepcopy(sd["param_groups"]), params, getattr(opt, "pending_grad_multiplier", None)


def assert_unchanged(before, opt):
    after = snapshot(opt)
    sa, sb = before[0], after[0]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), k
        for kk in sa[k]:
            a, b = sa[k][kk], sb[k][kk]
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (k, kk)
            else:
                assert a == b, (k, kk)
    assert repr(before[1]) == repr(after[1])
    for a, b in zip(before[2], after[2]):
        assert torch.equal(a, b)
    assert before[3] == after[3]


def _saved(tmp_path, mode="ram"):
    model, opt = make()
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    model2, opt2 = make(seed=3)
    if mode != "ram":  # the same optimizer with its state in an NVMe/mmap store
        opt2 = offload.AdamW([{"params": model2[0].parameters()}, {"params": model2[2].parameters(), "lr": 3e-3}],
                             lr=1e-2, amsgrad=True, **_mode_kwargs(mode, str(tmp_path) + "-state"))
    train(model2, opt2, 1, 0)
    return opt, opt2
