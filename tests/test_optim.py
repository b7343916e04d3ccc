# test_optim.py: offload.Adam/AdamW as drop-in torch optimizers: same results as torch.optim,
# param groups, schedulers, GradScaler, closure, state_dict interchange with torch, bad input.
import copy
import io
import pickle

import pytest
import torch

import offload
from offload import _C
from conftest import configs


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    return model.to(dtype)


def train(model, opt, steps, seed=1, sched=None, closure=False):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 13, generator=gen).to(dtype)
        y = torch.randn(8, 5, generator=gen).to(dtype)

        def fn():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
            return loss

        if closure:
            losses.append(float(opt.step(fn)))
        else:
            losses.append(float(fn().detach()))
            opt.step()
        if sched is not None:
            sched.step()
    return losses


VARIANTS = [   # the optimizer, torch's, and the hyperparameters they share
    (offload.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (offload.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (offload.Adam, torch.optim.Adam, dict(lr=1e-2)),
    (offload.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
    (offload.Adam, torch.optim.Adam, dict(lr=torch.tensor(1e-2), betas=(0.8, 0.99), eps=1e-6, amsgrad=True)),
]


@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("ram",), moments=("fp32",)))
@pytest.mark.parametrize("ours,theirs,kw", VARIANTS)
def test_matches_torch_fp32(ours, theirs, kw, cfg, tmp_path):
    m1, m2 = make_model(), make_model()
    o1 = ours(m1.parameters(), **cfg.kwargs(tmp_path, **kw))
    o2 = theirs(m2.parameters(), **kw, foreach=False)
    train(m1, o1, 25)
    train(m2, o2, 25)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o1.state[a][key], o2.state[b][key], rtol=1e-5, atol=1e-7)
        assert float(o1.state[a]["step"]) == float(o2.state[b]["step"]) == 25.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_master(dtype):
    m1 = make_model(dtype)
    m_ref = copy.deepcopy(m1).float()
    o1 = offload.AdamW(m1.parameters(), lr=1e-2)
    o_ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        for a, b in zip(m1.parameters(), m_ref.parameters()):
            g = torch.randn(a.shape, generator=gen).to(dtype)
            a.grad, b.grad = g, g.float()
        o1.step()
        o_ref.step()
    for a, b in zip(m1.parameters(), m_ref.parameters()):
        master = o1.state[a]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, b.detach(), rtol=1e-5, atol=1e-6)
        # the model's weight is exactly the rounded master
        assert torch.equal(a.detach(), master.to(dtype))


def test_param_groups_and_missing_grads():
    m1, m2 = make_model(), make_model()

    def groups(m):
        return [{"params": [m[0].weight], "lr": 1e-2, "weight_decay": 0.5},
                {"params": [m[0].bias, m[2].weight], "lr": 3e-3, "amsgrad": True},
                {"params": [m[2].bias], "betas": (0.5, 0.9)}]

    o1, o2 = offload.AdamW(groups(m1)), torch.optim.AdamW(groups(m2), foreach=False)
    gen = torch.Generator().manual_seed(2)
    for step in range(12):
        for (i, a), b in zip(enumerate(m1.parameters()), m2.parameters()):
            if (step + i) % 3 == 0:  # some params get no gradient in some steps
                a.grad = b.grad = None
            else:
                g = torch.randn(a.shape, generator=gen)
                a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert float(o1.state[a]["step"]) == float(o2.state[b]["step"])


def test_add_param_group_and_zero_grad():
    m = make_model()
    opt = offload.AdamW([m[0].weight, m[0].bias])
    train(m, opt, 2)
    opt.add_param_group({"params": list(m[2].parameters()), "lr": 5e-3})
    before = m[2].weight.detach().clone()
    train(m, opt, 2)
    assert not torch.equal(before, m[2].weight)
    assert float(opt.state[m[2].weight]["step"]) == 2.0
    assert float(opt.state[m[0].weight]["step"]) == 4.0
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [m[0].weight]})


def test_closure_returns_loss():
    m1, m2 = make_model(), make_model()
    l1 = train(m1, offload.Adam(m1.parameters(), lr=1e-2), 5, closure=True)
    l2 = train(m2, torch.optim.Adam(m2.parameters(), lr=1e-2), 5, closure=True)
    assert l1 == pytest.approx(l2, rel=1e-5)


@pytest.mark.parametrize("sched_fn", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 4),
    lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
])
def test_lr_schedulers(sched_fn):
    m1, m2 = make_model(), make_model()
    o1, o2 = offload.AdamW(m1.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
    s1, s2 = sched_fn(o1), sched_fn(o2)
    if isinstance(s1, torch.optim.lr_scheduler.ReduceLROnPlateau):
        for o, s, m in ((o1, s1, m1), (o2, s2, m2)):
            for loss in train(m, o, 15):
                s.step(loss)
    else:
        train(m1, o1, 15, sched=s1)
        train(m2, o2, 15, sched=s2)
    assert o1.param_groups[0]["lr"] == pytest.approx(o2.param_groups[0]["lr"])
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grad_scaler_skips_overflow_steps():
    m1, m2 = make_model(), make_model()
    o1, o2 = offload.AdamW(m1.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
    s1 = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s2 = torch.amp.GradScaler("cpu", init_scale=1024.0)
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        x, y = torch.randn(8, 13, generator=gen), torch.randn(8, 5, generator=gen)
        for m, o, s in ((m1, o1, s1), (m2, o2, s2)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            if step == 3:
                loss = loss * float("inf")  # overflow: the step must be skipped
            s.scale(loss).backward()
            s.step(o)
            s.update()
    assert s1.get_scale() == s2.get_scale() < 1024.0
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert float(o1.state[a]["step"]) == float(o2.state[b]["step"]) == 7.0


def test_clip_grad_norm_folds_into_step():
    m1, m2 = make_model(), make_model()
    o1, o2 = offload.AdamW(m1.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(6)
    for _ in range(6):
        x, y = torch.randn(8, 13, generator=gen), torch.randn(8, 5, generator=gen) * 50
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        n1 = o1.clip_grad_norm_(0.5)
        n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5)
        torch.testing.assert_close(n1, n2, rtol=1e-5, atol=0)
        o1.step()
        o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _roundtrip_continue(src_cls, dst_cls, dtype=torch.float32):
    """Train with src, save its state, load into dst, continue; compare with uninterrupted src."""
    m_a = make_model(dtype)
    o_a = src_cls(m_a.parameters(), lr=1e-2, amsgrad=True)
    train(m_a, o_a, 5)
    buf = io.BytesIO()
    torch.save(o_a.state_dict(), buf)  # as a real checkpoint: no tensor shared with o_a
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    m_b = copy.deepcopy(m_a)
    o_b = dst_cls(m_b.parameters(), lr=1e-2, amsgrad=True)
    o_b.load_state_dict(sd)
    train(m_a, o_a, 5, seed=9)
    train(m_b, o_b, 5, seed=9)
    return m_a, m_b, o_a, o_b


@pytest.mark.parametrize("src,dst", [(offload.AdamW, torch.optim.AdamW), (torch.optim.AdamW, offload.AdamW),
                                     (offload.AdamW, offload.AdamW)])
def test_state_dict_interchange_with_torch(src, dst):
    m_a, m_b, o_a, o_b = _roundtrip_continue(src, dst)
    exact = src is dst
    for a, b in zip(m_a.parameters(), m_b.parameters()):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd = o_a.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def test_state_dict_layout_is_torchs():
    m1, m2 = make_model(), make_model()
    o1, o2 = offload.AdamW(m1.parameters()), torch.optim.AdamW(m2.parameters())
    train(m1, o1, 1)
    train(m2, o2, 1)
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert set(s1["param_groups"][0]) == set(s2["param_groups"][0])
    for k in s2["state"]:
        assert set(s1["state"][k]) == set(s2["state"][k])
        for key, val in s2["state"][k].items():
            assert s1["state"][k][key].dtype == val.dtype and s1["state"][k][key].shape == val.shape
    # the saved step is a copy, not a view into the live counters
    s1["state"][0]["step"] += 100
    assert float(o1.state[m1[0].weight]["step"]) == 1.0


def test_bf16_state_dict_keeps_master_and_loads_into_torch():
    m = make_model(torch.bfloat16)
    o = offload.AdamW(m.parameters(), lr=1e-2)
    train(m, o, 3)
    sd = o.state_dict()
    assert sd["state"][0]["master_param"].dtype == torch.float32
    m2 = copy.deepcopy(m)
    o2 = offload.AdamW(m2.parameters(), lr=1e-2)
    o2.load_state_dict(sd)
    train(m, o, 3, seed=5)
    train(m2, o2, 3, seed=5)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    tor = torch.optim.AdamW(copy.deepcopy(m).parameters(), lr=1e-2)
    tor.load_state_dict(sd)  # torch accepts it (casts moments to bf16)


def test_load_state_dict_rejects_mismatch():
    m = make_model()
    o = offload.AdamW(m.parameters())
    train(m, o, 1)
    sd = o.state_dict()
    o2 = offload.AdamW([m[0].weight])
    with pytest.raises(ValueError, match="size"):
        o2.load_state_dict(sd)
    o3 = offload.AdamW([{"params": [m[0].weight, m[0].bias]}, {"params": list(m[2].parameters())}])
    with pytest.raises(ValueError, match="number of parameter groups"):
        o3.load_state_dict(sd)
    other = torch.nn.Sequential(torch.nn.Linear(13, 34), torch.nn.Tanh(), torch.nn.Linear(34, 5))
    o4 = offload.AdamW(other.parameters())
    with pytest.raises(ValueError, match="shape"):
        o4.load_state_dict(sd)


def test_optimizer_pickles():
    m = make_model()
    o = offload.AdamW(m.parameters())
    train(m, o, 2)
    o2 = pickle.loads(pickle.dumps(o))
    assert len(o2.param_groups) == 1


# ---------------------------------------------------------------- bad input

def test_rejects_bad_hyperparameters_like_torch():
    p = [torch.zeros(3, requires_grad=True)]
    for kw, msg in ((dict(lr=-1.0), "Invalid learning rate"), (dict(eps=-1.0), "Invalid epsilon value"),
                    (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
                    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
                    (dict(weight_decay=-1.0), "Invalid weight_decay value"),
                    (dict(lr=float("nan")), "Invalid learning rate")):
        with pytest.raises(ValueError, match=msg):
            offload.AdamW(p, **kw)
        with pytest.raises(ValueError, match=msg):
            torch.optim.AdamW(p, **kw)
    with pytest.raises(ValueError):
        offload.AdamW(p, threads=0)
    with pytest.raises(ValueError, match="capturable"):
        offload.AdamW(p, capturable=True)


def test_rejects_bad_params():
    # float64/complex/non-contiguous parameters are stepped by torch's code: tests/test_adversarial.py
    with pytest.raises(RuntimeError, match="sparse"):
        offload.AdamW([torch.zeros(4, 4).to_sparse().requires_grad_()])
    meta = torch.zeros(3, device="meta", requires_grad=True)
    with pytest.raises(RuntimeError, match="meta"):
        offload.AdamW([meta])


def test_rejects_bad_grads():
    p = torch.zeros(4, 4, requires_grad=True)
    opt = offload.AdamW([p])
    p.grad = torch.zeros(8, 4)[::2]  # right shape, not contiguous
    with pytest.raises(RuntimeError, match="not contiguous"):
        opt.step()
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = offload.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert float(opt.state[emb.weight]["step"]) == 0.0 if emb.weight in opt.state else True


def test_param_replaced_with_other_size_is_refused():
    p = torch.nn.Parameter(torch.zeros(10))
    opt = offload.AdamW([p])
    p.grad = torch.ones(10)
    opt.step()
    p.data = torch.zeros(12)
    p.grad = torch.ones(12)
    with pytest.raises(RuntimeError, match="changed size"):
        opt.step()


def test_param_data_reassigned_is_followed():
    p = torch.nn.Parameter(torch.zeros(10))
    opt = offload.AdamW([p], lr=0.1)
    p.grad = torch.ones(10)
    opt.step()
    new = p.detach().clone()
    p.data = new  # new storage: the kernel must write here, not into the old buffer
    p.grad = torch.ones(10)
    opt.step()
    assert p.data_ptr() == new.data_ptr()
    assert torch.all(new < -0.15)


def test_build_info_version_matches_package():
    info = offload.build_info()
    assert info["version"] == offload.__version__ == info["native_version"] == _C.__version__
    assert info["isa"] in info["available_isas"]
    assert info["threads"] >= 1
