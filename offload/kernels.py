"""kernels.py: ``offload.kernels``, the public, validated entry points of the native kernels.

Every function here takes tensors and checks them (CPU, dtype, contiguity, storage bounds, no
neg/conj bit, no overlap between buffers the update writes) before a pointer reaches C++. The
implementation and the internal table-level entries (``step_table``, ``step_moment_table``) live in
offload/native/adam.py and offload/native/moments.py, the tensor checks in offload/base/tensors.py;
nothing that accepts a raw address is exported here.
"""
from __future__ import annotations

from .base.tensors import check_storage, check_tensor, tensor_signature
from .native.adam import (DTYPE_CODES, MOMENT_PROBE_MODES, PROBE_MODES, adam_step, available_isas,
                          bandwidth_probe, bandwidth_probe_moments, get_isa, get_num_threads,
                          get_stream_prefetch, grad_sumsq, set_isa, set_num_threads,
                          set_stream_prefetch)
from .native.moments import (MOMENT_BLOCK, MOMENT_FORMATS, adam_step_moments, decode_moments,
                             moment_state)

__all__ = ["DTYPE_CODES", "adam_step", "grad_sumsq", "bandwidth_probe", "bandwidth_probe_moments",
           "PROBE_MODES", "MOMENT_PROBE_MODES", "check_tensor", "check_storage",
           "tensor_signature", "set_isa", "get_isa", "available_isas", "set_stream_prefetch",
           "get_stream_prefetch", "get_num_threads", "set_num_threads",
           "adam_step_moments", "decode_moments", "moment_state", "MOMENT_BLOCK", "MOMENT_FORMATS"]
