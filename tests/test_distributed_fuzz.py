"""test_distributed_fuzz.py: random sequences of what users do between steps, under DDP with
ZeroRedundancyOptimizer over 2 gloo ranks: offload.AdamW as ZeRO's optimizer against torch's AdamW,
side by side in each rank (new batches, lr and weight decay changed on the wrapper, moments edited
in place on the rank that owns them, a skipped backward with gradients zeroed in place, a
checkpoint saved and loaded, the state consolidated and loaded back, a param group added, torch's
clip_grad_norm_ on the all-reduced gradients). Each rank compares parameters and its shard's
state with the torch run to rounding. OFFLOAD_FUZZ_SEEDS=N runs N seeds instead of two.
"""
import os
import random

import pytest
import torch

import offload
from offload.bench.ranks import local_batch, model as make_model
from test_distributed import _run
from test_step_plan_fuzz import STATE_TOL, _near

SEEDS = int(os.environ.get("OFFLOAD_FUZZ_SEEDS", "0")) or 2
# (one sequence in 150 reached 5.1e-7 of a weight's largest magnitude: torch's clip_grad_norm_ of
# gradients of weights that differ by rounding already; a 1e-4 change of one moment gives 3.4e-6)
PARAM_TOL = 2e-6
ACTIONS = ["batch", "batch", "batch", "lr", "weight_decay", "edit_moment", "keep_grads",
           "checkpoint", "add_group", "consolidate", "clip"]


def _script(seed: int, steps: int = 6) -> list:
    rnd = random.Random(seed)
    return [[(rnd.choice(ACTIONS), rnd.randrange(1000)) for _ in range(rnd.randrange(3))]
            for _ in range(steps)]


def _build(cls, extra, **kw):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = DDP(make_model())
    return net, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=cls, lr=1e-2,
                                        weight_decay=0.1, **kw), extra


def _act(what, r, net, opt, extra, rank, step, tmp):
    if what == "lr":
        opt.param_groups[0]["lr"] = 1e-2 / (1 + r % 4)
    elif what == "weight_decay":
        opt.param_groups[0]["weight_decay"] = 0.05 * (r % 3)
    elif what == "edit_moment":   # this rank's shard, in place
        for st in opt.optim.state.values():
            if "exp_avg" in st:
                st["exp_avg"].mul_(0.5)
                break
    elif what == "checkpoint":
        path = os.path.join(tmp, f"ckpt{step}-{r}")
        offload.save(opt, path)
        offload.load(opt, path)
    elif what == "consolidate":   # the whole state on rank 0, then loaded on every rank
        import torch.distributed as dist
        opt.consolidate_state_dict(to=0)
        box = [opt.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        opt.load_state_dict(box[0])
    elif what == "add_group" and extra.grad is None:   # once: a new layer's bias
        opt.add_param_group({"params": [extra], "lr": 3e-3})
        extra.grad = torch.zeros_like(extra)


def _fuzz(rank, outdir):
    for seed in range(SEEDS):
        script = _script(seed * 5 + 1)
        names = [[a for a, _ in acts] for acts in script]
        runs = []
        for cls, kw in ((offload.AdamW, dict(threads=1)),
                        (torch.optim.AdamW, dict(foreach=False))):
            extra = torch.nn.Parameter(torch.full((5,), 0.1))
            net, opt, extra = _build(cls, extra, **kw)
            tmp = os.path.join(outdir, f"{cls.__module__}-{seed}")   # (the same on every rank)
            for step, acts in enumerate(script):
                batch = step
                for what, r in acts:
                    if what == "batch":
                        batch = 100 + r
                    _act(what, r, net, opt, extra, rank, step, tmp)
                if not any(what == "keep_grads" for what, _ in acts):
                    x, y = local_batch(batch, rank)
                    torch.nn.functional.mse_loss(net(x), y).backward()
                if extra.grad is not None:
                    extra.grad.fill_(0.01 * (step + 1))
                # the all-reduced gradients, the same on each rank
                if any(what == "clip" for what, _ in acts):
                    torch.nn.utils.clip_grad_norm_(list(net.parameters()) + [extra], 0.05)
                opt.step()
                opt.zero_grad(set_to_none=False)
            state = {i: {k: v.clone() for k, v in opt.optim.state[q].items() if torch.is_tensor(v)}
                     for i, q in enumerate(list(net.parameters()) + [extra])
                     if opt.optim.state.get(q)}   # (this rank's shard, by parameter)
            runs.append(([p.detach().clone() for p in net.parameters()] + [extra.detach().clone()],
                         state))
        (ps_a, st_a), (ps_b, st_b) = runs
        for i, (a, b) in enumerate(zip(ps_a, ps_b)):
            _near(a, b, PARAM_TOL, lambda: f"seed {seed} {names} parameter {i}")
        assert st_a.keys() == st_b.keys(), names
        for k in st_b:
            for key in st_b[k]:
                _near(st_a[k][key], st_b[k][key], STATE_TOL, lambda: f"seed {seed} {names} {key}")


@pytest.mark.timeout(120)
def test_zero_random_user_actions_equal_torch(tmp_path):
    _run("fuzz", tmp_path, module="test_distributed_fuzz")
