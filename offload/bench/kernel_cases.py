"""bench/kernel_cases.py: the cases and contenders of ``python -m offload.bench kernel``
(bench/kernel.py).

A ``Case`` is a list of tensor sizes (flat, many tensors, bf16 gradient + output); a ``Contender``
is one implementation stepping that case: ``offload.AdamW.step()``, our raw kernel call (also
forced to another ISA), torch's AdamW (fused / foreach), DeepSpeed's CPU Adam, and the native
bandwidth probe with the case's streams.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import offload
from offload.native import adam as native_adam

from .moments import _streams

STREAM_STAGGER = 16400  # floats between the probe's streams (as offload.optim's state arena)
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
             amsgrad=False, maximize=False)  # of the raw kernel call (OursKernel)
BYTES_PER_PARAM = 28  # read g, p, m, v (16 B) + write p, m, v (12 B)
# bf16 case: read p, m, v (12 B), the bf16 gradient (2 B) and the bf16 parameter (2 B: the step
# reads it for the user's writes, and a write-only stream costs its line's read all the same);
# write p, m, v and the parameter (14 B)
BYTES_PER_PARAM_BF16 = 30
# DeepSpeedCPUAdam on bf16 parameters: read the bf16 weight and gradient and fp32 m, v (12 B);
# write the weight and m, v (10 B). It keeps no fp32 master: each update is rounded into the bf16
# weight.
DS_BF16_BYTES = 22


def _count(n: int) -> str:   # an element count: 32M, 1.5K
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div and n % (div // 16 or 1) == 0:
            return f"{n / div:g}{unit}"
    return str(n)


@dataclass
class Case:
    key: str  # flat | multi | small | bf16 | isa | small-newgrads (what check_targets looks up)
    sizes: list
    lowp: bool = False  # bf16 grads in, bf16 weights out, fp32 master/moments
    results: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def bytes_per_param(self) -> int:
        return BYTES_PER_PARAM_BF16 if self.lowp else BYTES_PER_PARAM

    @property
    def footprint(self) -> int:
        """Bytes this case holds at once (an estimate, FOOTPRINT)."""
        return self.numel * FOOTPRINT[self.key]

    @property
    def name(self) -> str:
        n = self.sizes[0]
        shape = f"flat {_count(n)}" if len(self.sizes) == 1 else f"{len(self.sizes)}x{n}"
        if self.key == "isa":
            return f"avx2 vs avx512, fp32 {shape}"
        if self.key == "small-newgrads":
            return f"fp32 {shape}, new grads"
        return f"bf16 grad+out, {shape}" if self.lowp else f"fp32 {shape}"


# Bytes per parameter a case holds at once (the gradients; every contender's tensors: offload's
# parameters, master and moments, torch fused's and foreach's with foreach's temporaries,
# DeepSpeed's; the probe's streams; the cached random source). The moments case: its six contenders
# (76 B) and the probe regions all its probes share (20 B). kernel.run skips a case that would not
# fit in the memory available instead of being killed by the kernel's out-of-memory killer halfway
# through the run. Peak resident memory over the process's own, --full --scale 0.125, one case per
# run: flat 76.5, many tensors 73, bf16 86.5, moments 96, isa 36 B/param (setup's temporaries
# included).
FOOTPRINT = {"flat": 80, "multi": 80, "small": 80, "small-newgrads": 84, "isa": 40, "bf16": 90,
             "moments": 100}
CASE_KEYS = ("flat", "multi", "small", "bf16", "isa", "moments", "small-newgrads")
OPT_IN = ("small-newgrads",)  # only when named in --cases
DEFAULT_FLAT = 32 * 2**20  # 32M params: 900 MB moved per step, 28x a 32 MiB L3
FULL_FLAT = 128 * 2**20    # the sizes the speed targets are set on


def make_cases(scale: float, only, full: bool = False) -> list:
    flat = max(16, int((FULL_FLAT if full else DEFAULT_FLAT) * scale))
    multi = max(1, int((1000 if full else 250) * min(1.0, scale * 8)))
    cases = [
        Case("flat", [flat]),
        Case("multi", [max(1, int(131072 * min(1.0, scale)))] * multi),
        Case("small", [1024] * max(1, int(10000 * min(1.0, scale * 8)))),
        Case("bf16", [flat], lowp=True),
        Case("isa", [flat]),
        Case("moments", [flat]),  # compressed moments (offload/bench/moments.py)
        # a training loop's step: new gradient objects every step (zero_grad(set_to_none=True) +
        # backward), so every row is re-validated; two preallocated sets swapped before each step
        Case("small-newgrads", [1024] * max(1, int(10000 * min(1.0, scale * 8)))),
    ]
    if only:
        keys = [k.strip() for k in only.split(",") if k.strip()]
        unknown = sorted(set(keys) - set(CASE_KEYS))
        if unknown:
            raise SystemExit(f"--cases: unknown case(s) {', '.join(unknown)} (choose from "
                             f"{','.join(CASE_KEYS)})")
        cases = [c for c in cases if c.key in keys]
    else:
        cases = [c for c in cases if c.key not in OPT_IN]
    return cases


def has_avx512() -> bool:
    return "avx512" in native_adam.available_isas()


# --------------------------------------------------------------------------- contenders
_RANDOM = {}


def randn_like_sizes(sizes: list, dtype=torch.float32, scale: float = 1.0) -> list:
    """Random tensors of the given sizes, copied out of one cached random block (fast setup)."""
    need = max(sizes)
    src = _RANDOM.get("src")
    if src is None or src.numel() < need:
        src = _RANDOM["src"] = torch.randn(need)
    out = []
    for k, n in enumerate(sizes):
        start = (k * 7919) % max(1, src.numel() - n + 1)
        out.append((src[start:start + n] * scale).to(dtype))
    return out


class Contender:
    name = "?"
    threads = 1

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def prepare(self) -> None:
        """Untimed work before each timed step."""

    def step(self) -> None:
        raise NotImplementedError


class Ours(Contender):
    """offload.AdamW.step(): the drop-in optimizer, Python bookkeeping included."""
    name = "offload.AdamW.step"

    def __init__(self, case: Case, grads: list, threads: int):
        dtype = torch.bfloat16 if case.lowp else torch.float32
        self.params = [torch.nn.Parameter(t) for t in randn_like_sizes(case.sizes, dtype)]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = offload.AdamW(self.params, lr=1e-3, weight_decay=0.01, threads=threads)
        # small-newgrads: fresh grad objects before every step (two sets, swapped: no allocation
        # timed)
        self.grad_sets = ([grads, [g.clone() for g in grads]] if case.key == "small-newgrads"
                          else None)
        self.turn = 0

    def set_threads(self, threads: int) -> None:
        self.opt.kernel_threads = threads

    def prepare(self) -> None:
        if self.grad_sets is not None:
            self.turn ^= 1
            for p, g in zip(self.params, self.grad_sets[self.turn]):
                p.grad = g

    def step(self) -> None:
        self.opt.step()


class OursKernel(Contender):
    """One native call on a prebuilt pointer table: the kernel alone."""
    name = "offload kernel call"

    def __init__(self, ours: Ours, threads: int):
        # the optimizer's own state tensors (public opt.state), so the same memory as its step
        opt, ps = ours.opt, ours.params
        sts = [opt.state[p] for p in ps]
        masters = [st.get("master_param", p) for st, p in zip(sts, ps)]
        outs = [p if "master_param" in st else None for st, p in zip(sts, ps)]
        self.table = native_adam.adam_table(masters, [p.grad for p in ps],
                                            [st["exp_avg"] for st in sts],
                                         [st["exp_avg_sq"] for st in sts], None, [10] * len(ps),
                                            outs)
        # a bf16/fp16 parameter is the step's own output: the step also checks it for the user's
        # writes since the last step (and adopts them), so the call does the same work
        for i, o in enumerate(outs):
            if o is not None and o.dtype in native_adam.OUT_USER_PARAM:
                self.table[i, native_adam.COL_OD] = native_adam.OUT_USER_PARAM[o.dtype]
        self.threads = threads

    def step(self) -> None:
        native_adam.step_table(self.table, HYPER, 1.0, self.threads)


class OursKernelIsa(OursKernel):
    """The kernel call with the ISA forced (the native one restored after every step)."""

    def __init__(self, ours: Ours, threads: int, isa: str, native: str):
        super().__init__(ours, threads)
        self.isa, self.native = isa, native
        self.name = f"offload kernel call [{isa}]"

    def step(self) -> None:
        native_adam.set_isa(self.isa)
        try:
            super().step()
        finally:
            native_adam.set_isa(self.native)


class TorchAdamW(Contender):
    def __init__(self, case: Case, grads: list, threads: int, mode: str):
        self.name = f"torch AdamW({mode}=True)" + (" +casts" if case.lowp else "")
        self.threads = threads
        self.params = [torch.nn.Parameter(t) for t in randn_like_sizes(case.sizes)]
        self.lowp = case.lowp
        self.grads = grads
        if case.lowp:
            # the composite a user writes today: upcast bf16 grads, fp32 step, cast weights down
            self.model_weights = [torch.empty(n, dtype=torch.bfloat16) for n in case.sizes]
        else:
            for p, g in zip(self.params, grads):
                p.grad = g
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01, **{mode: True})

    def step(self) -> None:
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            if self.lowp:
                for p, g in zip(self.params, self.grads):
                    p.grad = g.float()
            self.opt.step()
            if self.lowp:
                torch._foreach_copy_(self.model_weights, self.params)
        finally:
            torch.set_num_threads(prev)


class DeepSpeed(Contender):
    """DeepSpeedCPUAdam on the case's parameters: fp32, or bf16 (its bf16 path keeps fp32 moments
    and no fp32 master: it rounds each update into the bf16 weights; DS_BF16_BYTES against
    BYTES_PER_PARAM_BF16)."""
    name = "DeepSpeedCPUAdam"

    def __init__(self, case: Case, grads: list, threads: int):
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: import here, optional
        self.threads = threads
        dtype = torch.bfloat16 if case.lowp else torch.float32
        self.params = [torch.nn.Parameter(t) for t in randn_like_sizes(case.sizes, dtype)]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = DeepSpeedCPUAdam(self.params, lr=1e-3, weight_decay=0.01, adamw_mode=True)

    def step(self) -> None:
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self.opt.step()
        finally:
            torch.set_num_threads(prev)


class MetadataFloor(Contender):
    """What any correct per-step check of many tensors must at least do, and nothing else: read
    each parameter's gradient, the parameter's data pointer and the gradient's (torch's own
    getters, called from C by map). Timed in the same round-robin, after the other contenders have
    streamed their memory through the caches, as the next step finds it. The optimizer reads more
    (dtype, shape, strides, neg bit of both: `t.data = ...` keeps the object and the pointer while
    changing them)."""
    name = "floor: 3 torch reads per tensor"

    def __init__(self, ours: "Ours"):
        self.params = ours.params
        tb = (getattr(torch._C, "TensorBase", None) or torch._C._TensorBase).__dict__
        self.data_ptr, self.grad = tb["data_ptr"], tb["grad"].__get__

    def step(self) -> None:
        list(map(self.data_ptr, self.params))
        list(map(self.data_ptr, list(map(self.grad, self.params))))


def _probe_streams(numel: int, lowp: bool) -> list:
    """The probe's streams: g, p, m, v in fp32 (Adam's pattern), or for the bf16 case p, m, v in
    fp32 and the bf16 gradient and parameter (the fp32-moment streams of bench/moments.py). One
    allocation, streams staggered like offload's state arena: separate allocations of a
    power-of-two size sit a power of two (+ one page) apart, and on some machines that costs a
    third of the bandwidth (measured on an AVX2 EPYC at 32M: 750 vs 1050 Mparam/s), which would
    make the "ceiling" lower than what a kernel can reach."""
    if lowp:
        p, g, m, v, out = _streams(numel, "fp32", True)
        for t in (p, g, m, v, out):
            # as the fp32 streams below (and every page touched before the first round)
            t.fill_(0.5)
        return [p, m, v, g, out]
    stride = numel + STREAM_STAGGER
    f32 = torch.full((4 * stride,), 0.5)
    return [f32[k * stride:k * stride + numel] for k in range(4)]


class Probe(Contender):
    """Bandwidth probe: a native pass over the case's streams (7 fp32 streams, Adam's pattern; for
    the bf16 case fp32 p, m, v, the bf16 gradient and the bf16 parameter read and written), same
    size, trivial arithmetic, walking memory in one of the probe's ways (PROBE_MODES). Without a
    mode it is the plain ceiling (fused + prefetch); with one it is one of the ceiling's candidates
    (probe_modes): run_case times them all in the round-robin and takes, round by round, the
    fastest as the ceiling, so that what this machine's memory does at best, not what one loop
    shape gets out of it, is the 100 % line."""
    name = CEILING = "bandwidth probe (ceiling)"

    def __init__(self, numel: int, threads: int, mode=None, bufs=None, lowp: bool = False):
        self.bufs = _probe_streams(numel, lowp) if bufs is None else bufs
        self.threads, self.numel, self.lowp = threads, numel, lowp
        self.mode = 0 if mode is None else mode
        if mode is not None:
            self.name = f"{MODE_PREFIX}{native_adam.PROBE_MODES[mode]}"

    def step(self) -> None:
        if self.lowp:
            p, m, v, g, out = self.bufs
            native_adam.bandwidth_probe_moments(p, m, v, g, out, threads=self.threads,
                                                mode=self.mode)
        else:
            g, p, m, v = self.bufs
            native_adam.bandwidth_probe(p, m, v, g, threads=self.threads, mode=self.mode)


MODE_PREFIX = "_probe: "  # contender names of the ceiling's candidates (hidden from the tables)
# the candidates timed in every round: one stream at a time (mode 3) was the slowest by 15-40 % in
# every case and thread count on the machines measured (docs/benchmarks.md), so it is left out
CEILING_MODES = (0, 1, 2)


def probe_modes(numel: int, threads: int, lowp: bool = False, bufs=None) -> list:
    """The ceiling's candidates, one per mode of CEILING_MODES, sharing one set of streams (they
    run in turn): ``bufs`` as Probe's, or new ones."""
    bufs = _probe_streams(numel, lowp) if bufs is None else bufs
    return [Probe(numel, threads, m, bufs=bufs, lowp=lowp) for m in CEILING_MODES]


def ceiling_series(times: dict) -> list:
    """Round by round, the fastest candidate's time: the ceiling each contender of that round is
    held to."""
    cands = [v for k, v in times.items() if k.startswith(MODE_PREFIX)]
    return [min(r) for r in zip(*cands)]


def deepspeed_available() -> bool:
    try:
        import deepspeed.ops.adam  # noqa: F401
        return True
    except Exception:
        return False


# --------------------------------------------------------------------------- running
