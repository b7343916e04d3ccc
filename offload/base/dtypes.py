"""base/dtypes.py: the dtypes and state keys every layer agrees on (one copy each).

``LOW_PRECISION``: the 16-bit parameter dtypes whose fp32 master copy the optimizer keeps (and the
16-bit gradient/output dtypes the kernel converts). ``NATIVE_DTYPES``: the parameter and gradient
dtypes the native kernel steps; other dtypes go to torch's code (offload/optim/fallback.py).
``TENSOR_STATE_KEYS``: the per-parameter state tensors offload keeps (torch's keys plus
``master_param``); ``STATE_KEYS``: the same with ``step`` first, the columns of the native check of
``opt.state`` entries (offload/engine/torchstate.py).
"""
import torch

__all__ = ["LOW_PRECISION", "NATIVE_DTYPES", "TENSOR_STATE_KEYS", "STATE_KEYS"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
NATIVE_DTYPES = (torch.float32,) + LOW_PRECISION
TENSOR_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
STATE_KEYS = ("step",) + TENSOR_STATE_KEYS
