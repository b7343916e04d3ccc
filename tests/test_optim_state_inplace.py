"""test_optim_state_inplace.py: the state tensors of opt.state are live views of the state in every
tier (NVMe and mmap files included): read after a step they hold its values, and an in-place write
into them (after opt.synchronize() for device parameters) is what the next step uses, as with
torch's state. The reference is the same optimizer given the written state through
load_state_dict, and torch.optim.AdamW for fp32 moments.
"""
import pytest

from conftest import configs
from test_optim_state_permute import Run


def _write(S, p):
    for q in p[:2]:
        S[q]["exp_avg"].mul_(3.0)
        S[q]["exp_avg_sq"][1:3] = 0.5


@pytest.mark.parametrize("cfg", configs(sides=("host", "fake"), moments=("fp32",), cover="all",
                                        schedules=("eager", "deferred", "sync")))
def test_in_place_writes_into_opt_state_are_used(make_opt, cfg):
    # the larger one is split over buckets (with the small host_budget of the NVMe rows, in
    # pieces of under a page per section: its tensors are copies, held to behave as views)
    run = Run(make_opt, cfg, [(6, 5), (40, 30)])
    run.permute(_write)
    run.check()   # (also: opt.state read after the steps holds torch's moments)
