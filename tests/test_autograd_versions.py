# test_autograd_versions.py: the step raises the version counters of the parameters the kernel wrote
# through their addresses, as torch's in-place update does: autograd then refuses a backward through
# values saved before the step (torch's answer) instead of computing gradients from the new weights,
# and the step's own write is not taken for a user's write at the next step.
import pytest
import torch

import offload
import offload.params.hostrows as hostrows


def _saved_then_stepped(make_opt, dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64, dtype=dtype))
    x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
    opt = make_opt([w])
    (x @ w).pow(2).sum().backward()
    loss = (x @ w).pow(2).sum()   # saves w for the backward of x @ w
    opt.step()                    # changes w in place
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", ["ram", "mmap"])
def test_backward_through_values_saved_before_the_step_raises_as_with_torch(dtype, storage, tmp_path):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _saved_then_stepped(lambda ps: torch.optim.AdamW(ps, lr=0.1), dtype).backward()
    kw = dict(storage=storage, nvme_dir=str(tmp_path)) if storage != "ram" else {}
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _saved_then_stepped(lambda ps: offload.AdamW(ps, lr=0.1, **kw), dtype).backward()


def test_each_step_moves_the_version_once_and_a_later_forward_is_fine():
    w = torch.nn.Parameter(torch.randn(32))
    opt = offload.AdamW([w], lr=0.1)
    for k in range(3):
        w.grad = torch.randn(32)
        v = w._version
        opt.step()
        assert w._version == v + 1
        (w * 2).sum().backward()   # saved after the step: no complaint


def test_the_steps_own_version_bump_is_not_a_user_write(monkeypatch):
    """bf16 parameters: the row records follow the bump, so warm steps do not revalidate every row
    (and the results still follow torch's fp32 step)."""
    torch.manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(300).bfloat16()) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ps]
    opt = offload.AdamW(ps, lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    checked = []
    real = hostrows.check_grad
    monkeypatch.setattr(hostrows, "check_grad", lambda *a, **k: (checked.append(a[3]), real(*a, **k))[1])
    for step in range(4):
        gs = [torch.randn(300) for _ in ps]
        for p, q, g in zip(ps, ref, gs):
            p.grad, q.grad = g.bfloat16(), g.bfloat16().float()
        checked.clear()
        opt.step()
        topt.step()
        if step > 0:
            assert checked == []   # every row as recorded: none revalidated in Python
    for p, q in zip(ps, ref):   # the fp32 master rounded: torch's fp32 step to within one bf16 rounding
        torch.testing.assert_close(p.float(), q.detach().bfloat16().float(), atol=1e-2, rtol=1e-2)


def test_the_functional_kernels_raise_the_versions_of_what_they_write():
    """offload.kernels.adam_step / adam_step_moments, like torch's in-place foreach/fused ops."""
    from offload import kernels
    p, g, m, v = torch.randn(100), torch.randn(100), torch.zeros(100), torch.zeros(100)
    out = torch.empty(100, dtype=torch.bfloat16)
    before = [t._version for t in (p, m, v, out)]
    kernels.adam_step([p], [g], [m], [v], None, [1], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0, decoupled=True, outs=[out])
    assert [t._version for t in (p, m, v, out)] == [b + 1 for b in before] and g._version == 0
    st = kernels.moment_state(100, "8bit")
    written = [p, st["exp_avg"], st["exp_avg_sq"], st["exp_avg_scale"], st["exp_avg_sq_scale"]]
    before = [t._version for t in written]
    kernels.adam_step_moments([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt="8bit", lr=1e-3, beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                              m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]])
    assert [t._version for t in written] == [b + 1 for b in before]
