"""native/: the one door to the compiled core ``offload._C`` (C++ in csrc/, built by setup.py).

This package is the only place that imports ``offload._C``; the shared library itself stays in the
package root (``offload._C``, next to offload/__init__.py). Everything else calls the Python
modules here, which check tensors before any pointer crosses into C++:

- ``adam``: the fp32-moment Adam kernel: task tables (``step_table``), ``adam_step``,
  ``grad_sumsq``, the bandwidth probes, ISA and thread-count settings.
- ``moments``: the same update over compressed (bf16 / 8-bit) moments.
- ``rows``: what the native per-step check of parameter rows is given (getters, record columns).
- ``aio``: the asynchronous O_DIRECT file engine the NVMe tier uses.

``info()`` reports the compiled core's version, ISA and threads (``offload.build_info()`` uses it).
"""
from .. import _C  # noqa: F401  (the modules of this package use it as ``from . import _C``)

__all__ = ["info"]


def info() -> dict:
    """The compiled core's version, chosen and available ISAs, the fp32 loop's software prefetch,
    thread count, CPUs in the affinity mask."""
    mode, prefetching = _C.get_stream_prefetch()
    return {
        "native_version": _C.__version__,
        "isa": _C.get_isa(),
        "available_isas": list(_C.available_isas()),
        "stream_prefetch": f"{'on' if prefetching else 'off'} ({mode})",
        "threads": _C.get_num_threads(),
        "affinity_cpus": _C.affinity_cpu_count(),
    }
