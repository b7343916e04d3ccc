"""bench/gpucheck_common.py: what every check of ``bench/gpu_check.py`` shares - the run context
(device kind, sizes, budgets, deterministic settings, the race amplifier), the per-check result,
small models, training loops and the bitwise / per-element comparisons.

On CUDA the parameters live on the GPU and the optimizer drives a ``CudaDevice``; with
``--device fake`` they are CPU tensors driven through offload's ``FakeDevice`` (copies on threads
with random delays, destinations poisoned with NaN until the copy lands).
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

import torch
import torch.nn as nn

from .gpt import GPT, GPTConfig, random_batch

NAN = float("nan")
LR = 1e-2


class Skip(Exception):
    """Raised by a check that cannot run here (the message says why)."""


class Result:
    def __init__(self, name: str):
        self.name = name
        self.failures: List[str] = []
        self.notes: List[str] = []
        self.data: dict = {}
        self.info_only = False
        self.skipped: Optional[str] = None
        self.err: Optional[str] = None
        self.n_expect = 0

    def expect(self, ok: bool, what: str, **data) -> bool:
        self.n_expect += 1
        if data:
            self.data[what] = data
        if not ok:
            self.failures.append(what + (": " + ", ".join(f"{k}={_short(v)}" for k, v in data.items()) if data else ""))
        return bool(ok)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def skip(self, reason: str) -> None:
        self.skipped = reason

    def error(self, e: BaseException, tb: str) -> None:
        self.failures.append(f"raised {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}"[:400])
        self.err = tb

    def record(self, seconds: float, budget, kind: str) -> dict:
        if self.failures:
            verdict = "FAIL"
        elif self.skipped is not None:
            verdict = "SKIP"
        elif self.info_only or self.n_expect == 0:
            verdict = "INFO"
        else:
            verdict = "PASS"
        parts = list(self.failures)
        if self.skipped is not None:
            parts.append(("stopped: " if self.failures else "") + self.skipped)
        if verdict == "PASS":
            parts.append(f"{self.n_expect} assertions")
        parts += self.notes
        rec = dict(name=self.name, verdict=verdict, seconds=round(seconds, 3),
                   detail="; ".join(parts), budget_s=budget, device=kind, data=self.data)
        if self.err:
            rec["traceback"] = self.err
        return rec


def _short(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    s = str(v)
    return s if len(s) < 120 else s[:117] + "..."


# per-check budgets in seconds: (cuda, fake, fake --quick); None: not run in that mode
_BUDGETS = {
    "00_environment": (40, 6, 3), "01_schedule_equivalence": (25, 14, 4),
    "02_engine_claim": (12, 6, 2),
    "03_parity_torch_adamw": (15, 10, 3), "04_tiers": (15, 8, 3), "05_moments": (12, 8, 3),
    "06_accumulation": (8, 5, 2), "07_clipping": (8, 5, 2), "08_gradscaler": (12, 7, 2),
    "09_bf16_autocast": (8, 4, 2), "10_release_grads": (8, 4, 1.5), "11_small_params": (6, 3, 1),
    "12_user_writes": (10, 6, 2), "13_non_owner_reads": (15, 6, 2),
    "14_torch_compile": (45, 45, None),
    "15_user_stream": (6, 1, 1), "16_fsdp2": (20, 10, 3), "17_ddp": (12, 6, 2),
    "18_robustness": (25, 20, 8), "19_delayed_updates": (12, 6, 2), "20_two_ranks": (75, 60, None),
    "perf_setup": (8, 2, 1), "perf_baseline": (12, 3, 2), "perf_torch_fused": (12, 3, None),
    "perf_offload_eager": (15, 4, 3), "perf_offload_deferred_clip": (15, 4, None),
    "perf_offload_sync": (15, 4, None),
    "perf_offload_nvme": (45, 5, None), "perf_offload_8bit": (15, 4, None),
    "perf_offload_delayed": (15, 4, None), "perf_profiler": (15, 5, None),
    "perf_thread_sweep": (40, 6, None), "perf_bucket_sweep": (35, 6, None),
    "perf_fingerprint_cost": (12, 3, None),
    "perf_memory_vs_plan": (10, 2, None), "perf_trace_lanes": (10, 3, None),
    "perf_peers": (30, 3, None), "perf_summary": (1, 1, 1),
}


class Ctx:
    def __init__(self, args):
        self.args = args
        self.kind = args.device
        self.cuda = self.kind == "cuda"
        self.quick = bool(args.quick)
        self.budget_s = float(args.budget_s if args.budget_s is not None else
                              (480 if self.cuda else (40 if self.quick else 170)))
        self.t_start = time.time()
        self.global_deadline = self.t_start + self.budget_s
        self.check_deadline = self.global_deadline
        self.check_budget = 0.0
        self.tdev = torch.device("cuda" if self.cuda else "cpu")
        self.steps = args.steps or (6 if self.cuda else 3 if self.quick else 4)
        if self.cuda:
            self.gpt_cfg = GPTConfig(vocab=512, seq=64, n_layer=4, n_head=4, d_model=256)
            self.width, self.bucket_mb, self.batch = 256, 0.25, 4
        else:
            self.gpt_cfg = GPTConfig(vocab=64, seq=16, n_layer=2, n_head=2, d_model=32)
            self.width, self.bucket_mb, self.batch = 32, 0.002, 2
        # two identical overlap=False runs agree bitwise (set lazily)
        self.bitwise: Optional[bool] = None
        self.fake_delay = (0.0, 0.002)
        self._owned: list = []   # optimizers and devices to close after the check
        self._patches: list = []
        self._tmp = None
        self.perf: dict = {}     # shared by the perf checks
        # beside the JSON lines: traces worth reading afterwards
        self.out_dir: Optional[str] = None

    # -------------------------------------------------------------- budgets and lifecycle
    def budget_of(self, name: str):
        b = _BUDGETS.get(name, (10, 5, 2))
        return b[0] if self.cuda else (b[2] if self.quick else b[1])

    def tick(self) -> None:
        """Cooperative per-check deadline (loops call it): a check stops at twice its budget, or
        when the global budget is spent."""
        now = time.time()
        if now > self.check_deadline + self.check_budget:
            raise Skip(f"ran out of its time budget ({self.check_budget:.0f} s, "
                       "stopped at twice that)")
        if now > self.global_deadline:
            raise Skip("the global budget (--budget-s) ran out")

    def setup(self) -> None:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        else:
            # 2 busy cores: the fake device's stream threads and the worker need the rest
            torch.set_num_threads(1)
        base = self.args.nvme_dir or (os.getcwd() if os.access(os.getcwd(), os.W_OK) else None)
        self._tmp = tempfile.mkdtemp(prefix=".gpu-check-", dir=base)

    def teardown(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def disk_dir(self, tag: str) -> str:
        return tempfile.mkdtemp(prefix=tag + "-", dir=self._tmp)

    def cleanup(self, res: Result) -> None:
        for obj in reversed(self._owned):
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001 - reported, not raised
                res.note(f"close() of {type(obj).__name__} raised {type(e).__name__}: {e}"[:200])
            if hasattr(obj, "violations"):
                v = obj.violations
                res.expect(not v, "no fake-device hazards", first=v[0] if v else None)
        self._owned.clear()
        self.unpatch()
        self.fake_delay = (0.0, 0.002)
        # a check that compiled (14) leaves dynamo's frame counter set, and device parameters then
        # wait for every upload in step() (schedule/uploads.compiled_code_in_use) in all later
        # checks and perf rows: cleared, so that they run the overlapped schedules a process
        # without compiled code runs
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is not None:
            utils.counters.clear()
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        if self.cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                res.failures.append("torch.cuda.synchronize() after the check raised "
                                    f"{type(e).__name__}: {e}"[:300])

    def close(self, obj) -> None:
        """Close an optimizer or device now (once: it is no longer closed after the check)."""
        self._owned = [o for o in self._owned if o is not obj]
        obj.close()

    def forget(self, obj) -> None:
        """Close ``obj`` now, ignoring errors and fake-device hazards (a deliberately wrong
        sub-case)."""
        self._owned = [o for o in self._owned if o is not obj]
        try:
            obj.close()
        except Exception:  # noqa: BLE001
            pass

    def unpatch(self) -> None:
        """Undo every ctx.patch() of this check now."""
        for undo in reversed(self._patches):
            undo()
        self._patches.clear()

    def patch(self, obj, attr: str, value) -> None:
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        self._patches.append(lambda: setattr(obj, attr, old))

    @contextlib.contextmanager
    def section(self, name: str):
        """Settings of a correctness check: math SDPA (bitwise-reproducible attention)."""
        if name.startswith("perf"):
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.MATH]):
            yield

    # -------------------------------------------------------------- devices and optimizers
    def offload_device(self):
        from offload.device import CudaDevice, FakeDevice
        if self.cuda:
            dev = CudaDevice(self.tdev)
        else:
            dev = FakeDevice(max_delay=self.fake_delay[1], min_delay=self.fake_delay[0],
                             seed=len(self._owned))
        self._owned.append(dev)
        return dev

    def opt(self, params, cls: str = "AdamW", **opts):
        import offload
        opts.setdefault("lr", LR)
        if opts.get("offload_device", "x") is not None:
            opts.setdefault("bucket_mb", self.bucket_mb)
            opts["offload_device"] = opts.get("offload_device") or self.offload_device()
        else:
            opts.pop("offload_device")
        o = getattr(offload, cls)(params, **opts)
        self._owned.append(o)
        return o

    @contextlib.contextmanager
    def amplified(self):
        """The race amplifier: on CUDA every side-stream copy first sleeps ~2e6 cycles and poisons
        its destination with NaN (device destinations on the side stream after its wait, pinned
        host slots on the host before the copy is issued); on the fake device, longer random copy
        delays."""
        if not self.cuda:
            old = self.fake_delay
            self.fake_delay = (0.0005, 0.005)
            try:
                yield
            finally:
                self.fake_delay = old
            return
        from offload.device.cuda import CudaDevice
        orig = CudaDevice._copy

        def _copy(dev, stream, pairs, after, d2h):
            pairs = list(pairs)
            if d2h:
                for dst, _ in pairs:
                    if dst.is_floating_point():
                        dst.fill_(NAN)   # pinned host slot, on the host, before the copy is issued
            with torch.cuda.device(dev.device), torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after._end)
                torch.cuda._sleep(2_000_000)
                if not d2h:
                    for dst, _ in pairs:
                        if dst.is_floating_point():
                            dst.fill_(NAN)   # the device destination, ordered after the wait
            return orig(dev, stream, pairs, after, d2h)

        CudaDevice._copy = _copy
        try:
            yield
        finally:
            CudaDevice._copy = orig

    # -------------------------------------------------------------- data
    def gpt(self, dtype=torch.float32, cfg: Optional[GPTConfig] = None):
        torch.manual_seed(0)
        return GPT(cfg or self.gpt_cfg).to(device=self.tdev, dtype=dtype)

    def gpt_batches(self, n: int, cfg: Optional[GPTConfig] = None, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        return [random_batch(cfg or self.gpt_cfg, self.batch, self.tdev, gen) for _ in range(n)]

    def mlp(self, dtype=torch.float32, depth: int = 3, width: Optional[int] = None):
        torch.manual_seed(0)
        d = width or self.width
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.LayerNorm(d)]
        return nn.Sequential(*layers).to(device=self.tdev, dtype=dtype)

    def mlp_batches(self, n: int, seed: int = 1, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        return [(torch.randn(self.batch * 4, self.width, generator=gen).to(self.tdev, dtype),
                 torch.randn(self.batch * 4, self.width, generator=gen).to(self.tdev, dtype)) for _ in range(n)]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # -------------------------------------------------------------- comparisons
    def compare(self, res: Result, what: str, ref: list, got: list, rtol: float = 1e-5,
                atol: float = 1e-7, exact: Optional[bool] = None) -> bool:
        """Bitwise when runs are reproducible here (or ``exact``), else per element within rtol/atol."""
        exact = (self.bitwise is not False) if exact is None else exact
        if len(ref) != len(got):
            return res.expect(False, what, why=f"{len(ref)} vs {len(got)} tensors")
        worst, bad, nonfinite = 0.0, None, 0
        for i, (a, b) in enumerate(zip(ref, got)):
            a, b = a.detach(), b.detach()
            nonfinite += int((~torch.isfinite(b.float())).sum()) - int((~torch.isfinite(a.float())).sum())
            d = (a.double() - b.double()).abs()
            d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
            m = float(d.max()) if d.numel() else 0.0
            ok = same_bits(a, b) if exact else bool((d <= atol + rtol * a.double().abs()).all())
            if not ok and bad is None:
                bad = i
            worst = max(worst, m)
        return res.expect(bad is None, what, bitwise=bool(exact), first_bad_tensor=bad,
                          max_abs_diff=worst, new_nonfinite=nonfinite)

    def compare_moved(self, res: Result, what: str, init: list, ref: list, got: list, tol: float) -> bool:
        """For runs that cannot agree bitwise (torch's CUDA kernels round differently from the CPU
        kernel, and through the forward the differences grow with every step): the L2 distance
        between the two runs' parameters over how far the reference moved from ``init`` (L2 over
        all of them), at most ``tol``. Adam moves an element by ~lr whatever its gradient, so
        per-element bounds do not hold."""
        moved, dist = l2_dist(ref, init), l2_dist(ref, got)
        finite = all(bool(torch.isfinite(t.float()).all()) for t in got)
        return res.expect(finite and dist <= tol * moved, what, dist_over_moved=dist / moved if moved else math.inf,
                          tol=tol, finite=finite)


def l2_dist(a: list, b: list) -> float:
    """L2 distance between two lists of tensors, taken as one vector."""
    return sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b)) ** 0.5


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.is_floating_point():
        it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(it), b.view(it)
    return bool(torch.equal(a, b))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(params) -> list:
    return [local(p).detach().to("cpu", copy=True) for p in params]


def state_tensors(opt) -> list:
    """Every tensor of ``opt.state_dict()['state']``, in a fixed order, on the CPU."""
    st = opt.state_dict()["state"]
    out = []
    for k in sorted(st, key=str):
        for name in sorted(st[k]):
            v = st[k][name]
            if isinstance(v, torch.Tensor):
                out.append(local(v).detach().to("cpu", copy=True).reshape(-1))
    return out
