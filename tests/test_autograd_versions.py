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
