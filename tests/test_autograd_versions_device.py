# test_autograd_versions_device.py: on the device path the step raises the version counters of the
# parameters whose new weights it uploads, as torch's in-place update does, so autograd refuses a
# backward through values a forward saved before step() (the GAN pattern: the discriminator stepped
# between the generator's forward and its backward) instead of computing gradients from the new
# weights; in every schedule, through the fake device. Parameters without a gradient are not touched,
# and the step's own bump is not taken for a user's write.
import pytest
import torch

import offload
from offload.device import FakeDevice
from conftest import _SCHEDULE_KW, SCHEDULES


def _opt(params, schedule, **kw):
    return offload.AdamW(params, lr=0.1, offload_device=FakeDevice(max_delay=0.001, seed=1), bucket_mb=0.01,
                         **_SCHEDULE_KW[schedule], **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_backward_through_values_saved_before_the_step_raises_as_with_torch(schedule, dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64, dtype=dtype))
    frozen = torch.nn.Parameter(torch.randn(64, dtype=dtype))   # in the optimizer, never given a gradient
    x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
    opt = _opt([w, frozen], schedule)
    (x @ w).pow(2).sum().backward()
    loss = (x @ w).pow(2).sum()                          # saves w for the backward of x @ w
    kept = (x * frozen.detach().requires_grad_()).sum()  # saves a parameter the step does not change
    v_frozen = frozen._version
    opt.step()
    opt.synchronize()
    assert frozen._version == v_frozen
    kept.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    opt.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_steps_own_bump_is_not_a_user_write(schedule):
    """Training as usual: one bump per step, no write race reported, and the weights follow a plain run
    of the same schedule on the same fake device bit for bit (nothing re-read as if the user wrote it)."""
    def run(check):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).bfloat16()
        opt = _opt(model.parameters(), schedule)
        for _ in range(4):
            before = [p._version for p in model.parameters()]
            model(torch.randn(8, 16).bfloat16()).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if check:
                assert all(p._version > b for p, b in zip(model.parameters(), before))
        opt.synchronize()
        out = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return out
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_counts_move_their_version_as_torchs_do(schedule):
    """torch's ``state_steps`` advance in place (``step += 1``), so ``opt.state[p]['step']._version`` moves
    at every step; offload's step counts do the same in every schedule (one place advances them)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = _opt([w], schedule)
    seen = []
    for _ in range(3):
        (torch.randn(8, 64) @ w).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        step = opt.state[w]["step"]
        seen.append((float(step), step._version))
    assert [s for s, _ in seen] == [1.0, 2.0, 3.0]
    assert seen[0][1] < seen[1][1] < seen[2][1], seen
