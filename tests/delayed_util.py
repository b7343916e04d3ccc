"""delayed_util.py: helpers of the tests of ``delay_updates=1`` (test_delayed_updates.py and the
tests of what the delayed update keeps consistent): a small model and its data, ``reference`` (the
rule of docs/gpu.md written out with a plain optimizer over fp32 masters), ``ours`` (the same
training run by the delayed update on a device) and the comparison of the two.
"""
import torch
import torch.nn as nn

import offload
from offload import testing
from offload.device import FakeDevice

LR, WD, STEPS = 1e-2, 0.1, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.norm(torch.relu(self.a(x)))))).float().square().mean()


def make_net(dtype):
    torch.manual_seed(0)
    return Net().to(dtype)


def batches(n, accum=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(8, 16, generator=gen).to(dtype) for _ in range(accum)] for _ in range(n)]


def losses_of(model, micro, inf=False, scale=lambda loss: loss):
    out = []
    for k, x in enumerate(micro):
        loss = model(x)
        out.append(loss.item())
        if inf and k == len(micro) - 1:
            loss = loss * float("inf")
        scale(loss).backward()
    return out


def reference(kind, dtype, data, clip=None, inf_step=None, after=0, extrapolate=False, frozen=None,
              sync=(), clear=None, opt_kw=None, between=None):
    """The rule with a plain optimizer: ``model`` holds the weights forward sees, ``master`` the
    fp32 masters. An update is exact (the model gets its weights at once) while fewer than ``after``
    were applied before it (a skipped step is no update), else pending: the next step() gives the
    model its weights, w, or with ``extrapolate`` (for a parameter the update before stepped too,
    when that one was pending) w + (w - w_before), computed in fp32 from the weights in the
    parameters' dtype; a skipped step gives them w itself.
    ``frozen``: {iteration: indices of the parameters without a gradient then}. ``sync``: iterations
    where the pending update is completed between backward and step() (``opt.synchronize()``): it
    goes up as w, and the next one is not extrapolated. ``clear``: {iteration: indices of the
    parameters whose state is deleted between backward and step()}: ``sync`` first; a fresh master
    is the parameter, in its dtype (the step count starts again when every state is deleted).
    ``opt_kw``: more options of the optimizer. ``between(t, opt, master)`` runs before the step of
    iteration t (the update before it applied, as the optimizer shows it between backward and
    step())."""
    model = make_net(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = (offload.AdamW(master, lr=LR, weight_decay=WD, **(opt_kw or {})) if kind == "offload" else
           torch.optim.AdamW(master, lr=LR, weight_decay=WD, foreach=False))
    frozen, clear = frozen or {}, clear or {}
    losses, updates, pending, before = [], 0, None, None   # before: (weights, stepped), pending
    for t, micro in enumerate(data):
        losses += losses_of(model, micro, inf_step == t)
        if pending is not None:   # step(): the pending update goes up
            with torch.no_grad():
                for p, w, e in zip(model.parameters(), *pending):
                    p.copy_(w if inf_step == t or t in sync or t in clear else e)
            pending = None
        if t in sync or t in clear:
            before = None
        for i in clear.get(t, ()):
            opt.state.pop(master[i], None)
            with torch.no_grad():
                master[i].copy_(list(model.parameters())[i].float())
        if len(clear.get(t, ())) == len(master):
            updates = 0
        if between is not None:
            between(t, opt, master)
        held = updates >= after
        if inf_step != t:   # an overflow skips the update (the pending one still lands)
            stepped = [i not in frozen.get(t, ()) for i in range(len(master))]
            for m, p, s in zip(master, model.parameters(), stepped):
                m.grad = p.grad.float() if s else None
            if clip is not None:
                (opt.clip_grad_norm_ if kind == "offload" else
                 lambda c: torch.nn.utils.clip_grad_norm_(master, c))(clip)
            opt.step()
            updates += 1
            new = [m.detach().to(p.dtype, copy=True) for m, p in zip(master, model.parameters())]
            if not held:
                with torch.no_grad():
                    for p, w in zip(model.parameters(), new):
                        p.copy_(w)
            ext = [(w.float() + (w.float() - before[0][i].float())).to(w.dtype)
                   if extrapolate and before and s and before[1][i] else w
                   for i, (w, s) in enumerate(zip(new, stepped))]
            pending, before = ((new, ext), (new, stepped)) if held else (None, None)
        model.zero_grad(set_to_none=True)
    return losses, [m.detach() for m in master], opt


def ours(dtype, data, *, device=None, delay=1, clip=None, inf_step=None, scaler=None, accum_with=None,
         state_opts=None, bucket_mb=0.002, after=0, extrapolate=None, frozen=None, between=None):
    """The run of ``reference`` by the delayed update: ``frozen`` as there (their gradients dropped
    after backward); ``between(t, model, opt)`` runs between backward and step() of iteration t."""
    model = make_net(dtype)
    if delay:   # (after=None: the default warm-up)
        state_opts = dict(state_opts or {}, **({} if after is None else dict(delay_after=after)),
                          **({} if extrapolate is None else dict(delay_extrapolate=extrapolate)))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, bucket_mb=bucket_mb,
                        offload_device=device or FakeDevice(max_delay=0.002, seed=1), delay_updates=delay,
                        max_grad_norm=clip, check_overflow=inf_step is not None or scaler is not None,
                        **(state_opts or {}))
    losses, scale = [], (scaler.scale if scaler is not None else lambda loss: loss)
    for t, micro in enumerate(data):
        with (opt.no_sync() if accum_with == "no_sync" and len(micro) > 1 else _null()):
            losses += losses_of(model, micro[:-1], scale=scale)
        losses += losses_of(model, micro[-1:], inf_step == t, scale)
        params = list(model.parameters())
        for i in (frozen or {}).get(t, ()):
            params[i].grad = None
        if between is not None:
            between(t, model, opt)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return model, opt, losses


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def assert_matches(model, opt, ref, exact=True):
    losses, master, ropt = ref
    opt.synchronize()   # completes the pending update: the device weights are the masters now
    sd, rsd = opt.state_dict()["state"], ropt.state_dict()["state"]
    for i, (p, m) in enumerate(zip(model.parameters(), master)):
        got_m = sd[i]["master_param"] if "master_param" in sd[i] else p.detach()
        for a, b, what in ((got_m, m, "master"), (p.detach(), m.to(p.dtype), "weight"),
                           (sd[i]["exp_avg"], rsd[i]["exp_avg"], "exp_avg"),
                           (sd[i]["exp_avg_sq"], rsd[i]["exp_avg_sq"], "exp_avg_sq")):
            if exact:
                assert torch.equal(a, b), f"param {i} {what}: max diff {(a.float() - b.float()).abs().max()}"
            else:
                torch.testing.assert_close(a.float(), b.float(), atol=2e-5 if what != "weight" or p.dtype ==
                                           torch.float32 else 1e-2, rtol=1e-4)
        assert float(sd[i]["step"]) == float(rsd[i]["step"])


def assert_same_run(model, opt, model2, opt2):
    """Two runs ended in the same weights and optimizer state, bitwise (after synchronize())."""
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def check_device(opt):
    dev = testing.device(opt)
    if isinstance(dev, FakeDevice):
        dev.check()


def tier_opts(cfg, tmp_path) -> dict:
    """The options of conftest's Config ``cfg`` that say where the state lives and how moments are
    stored (``ours``'s state_opts)."""
    kw = cfg.kwargs(tmp_path)
    keys = ("storage", "nvme_dir", "host_budget", "moments", "moments_min_size")
    return {k: kw[k] for k in keys if k in kw}


def moment_opts(cfg) -> dict:
    """The moment format of ``cfg`` (``reference``'s opt_kw: the tier changes no value)."""
    return dict(moments=cfg.moments, moments_min_size=0) if cfg.moments != "fp32" else {}


def train(model, opt, data) -> list:
    """Go on training ``model`` with ``opt`` on ``data``: the losses of every micro-batch."""
    losses = []
    for micro in data:
        losses += losses_of(model, micro)
        opt.step()
        opt.zero_grad()
    return losses
