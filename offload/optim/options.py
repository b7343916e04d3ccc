"""optim/options.py: offload's own constructor options of ``offload.Adam`` / ``offload.AdamW``
(beyond torch's): their documentation (appended to both classes' docstrings, so ``help()`` shows
each one), which GPU-offload options the caller actually gave, which options are the whole
optimizer's, never a param group's (``OPTIMIZER_WIDE``), and a subclass constructor's arguments as
the base class takes them.
"""
from __future__ import annotations

__all__ = ["OPTIONS_DOC", "GPU_OPTION_NAMES", "OPTIMIZER_WIDE", "constructor_args",
           "given_gpu_options"]

GPU_OPTION_NAMES = ("bucket_mb", "overlap", "step_during_backward", "max_grad_norm",
                    "check_overflow",
                    "release_grads", "trace", "small_param_numel", "delay_updates", "delay_after",
                    "delay_extrapolate", "gpu_state")

# the constructor's own options (not torch's hyperparameters): per optimizer, never per param group
OPTIMIZER_WIDE = ("moments", "moments_min_size", "storage", "state", "threads", "nvme_dir",
                  "host_budget", "keep_files", "nvme_options", "offload_device") + GPU_OPTION_NAMES

OPTIONS_DOC = """
    offload's own keyword arguments (after torch's):

    threads: native threads of the CPU kernel. Default: every CPU of this process (host
        parameters), all but two with parameters on a GPU (left to the threads that launch GPU
        work).
    storage: where the fp32 master weights and Adam moments live: ``"ram"`` (host memory),
        ``"nvme"`` (a file in ``nvme_dir``, read and written with O_DIRECT, host memory bounded by
        ``host_budget``) or ``"mmap"`` (a mapped file in ``nvme_dir``). Default: ``"nvme"`` when
        ``nvme_dir`` is given, else ``"ram"``. docs/nvme.md. ``state=`` is a deprecated alias (a
        name ``Optimizer.state`` also has), accepted with a DeprecationWarning.
    nvme_dir: directory for the state file of ``storage="nvme"|"mmap"`` (a private subdirectory is
        created there and removed by ``close()`` unless ``keep_files``), or several comma-separated
        (one per drive). Giving it alone is enough.
    host_budget: host memory for NVMe state buffers, bytes or a string like ``"2GiB"``.
    keep_files: keep the state directory after ``close()``.
    nvme_options: tuning of the NVMe tier (``depth``, ``staging_slots``, ...); docs/nvme.md.
    moments: ``"fp32"`` (torch's), ``"bf16"`` or ``"8bit"`` compressed Adam moments;
        docs/moments.md.
    moments_min_size: tensors with fewer elements keep fp32 moments.
    offload_device: None (default: the parameters' GPU when they are on one, else the CPU mode),
        ``"cuda"``/``"cuda:k"`` or an ``offload.device.CudaDevice``; ``"fake"``/``"cpu-test"`` and
        ``FakeDevice``/``CpuDevice`` are test devices that drive CPU tensors as if on a GPU.

    Parameters on a GPU only (docs/gpu.md); None means the default:
    bucket_mb: bucket size in MB of parameters (default 32).
    overlap: False runs every copy and the CPU step inside ``step()`` (default True).
    step_during_backward: step buckets while backward runs (default: True unless ``max_grad_norm``
        or ``check_overflow`` is set or several torch.distributed ranks run).
    max_grad_norm: clip the global gradient norm inside ``step()``.
    check_overflow: skip a step whose gradients are not finite (needed with
        ``torch.amp.GradScaler``).
    release_grads: set ``p.grad = None`` as soon as a gradient is handed to the CPU step.
    trace: record a timeline for ``export_chrome_trace(path)``.
    small_param_numel: parameters of at most this many elements stay on the GPU, stepped by torch.
    delay_updates: 0 (exact, default) or 1: the CPU step of each iteration runs during the next
        forward and backward, which see the weights before it (one step of staleness; docs/gpu.md).
    delay_after: with ``delay_updates=1``, the number of steps run exact before the delay starts
        (default 50: the first steps, when the weights change fastest, are where staleness costs
        most).
    delay_extrapolate: with ``delay_updates=1``, True: each forward sees the weights it would have
        seen without delay predicted from the last update, w + (w - w_before) (default False; it
        costs one more host copy of the parameters and a pass over them per step; docs/gpu.md).
    gpu_state: device memory for the Adam state (fp32 master and moments) of the parameters
        backward reaches last, stepped on the GPU so that the CPU's part of the step ends inside
        backward: ``"auto"`` (default: what the first steps leave spare, with a margin, as much as
        hiding the CPU step needs), a size (``"8GiB"``: at most that), or 0 (every parameter's
        state in host memory). Decided after the second step, refined after the fourth;
        docs/gpu.md.
"""


def given_gpu_options(**options) -> dict:
    """The GPU-offload options the caller gave (None: not given, the mode's default applies)."""
    return {k: v for k, v in options.items() if v is not None}


def constructor_args(args: dict) -> dict:
    """A subclass constructor's arguments (its ``locals()``), as keywords for the base class's
    __init__."""
    return {k: v for k, v in args.items() if k not in ("self", "__class__")}
