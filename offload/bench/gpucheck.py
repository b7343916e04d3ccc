"""bench/gpucheck.py: the runner behind ``bench/gpu_check.py`` - check registry, time budgets,
verdicts, JSON lines.

Every check is a function ``fn(ctx, res)`` (the gpucheck_ modules next to this one) with its own
time budget. The runner skips a check (verdict SKIP, with the reason) when its budget does not fit
in what is left of ``--budget-s``, runs it under try/except (an exception is a FAIL verdict
carrying the error, never the end of the script), appends one JSON line per check to ``--out``
(flushed and fsynced, so that a run killed by a timeout still leaves its results) and prints one
verdict line per check: ``PASS|FAIL|SKIP|INFO  <name>  <detail>``. A watchdog ends the process,
after recording the hung check as FAIL and dumping every thread's stack, if one check runs far past
its budget.

Also kept here: ``run_checks`` / ``check_case`` / ``print_checks``, the GPT-model parity cases
against torch.optim.AdamW on the same device (offload/bench/gpucheck_parity.py), used by the tests.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import List

import torch

from .gpucheck_common import Ctx, Result, Skip
from .gpucheck_parity import check_case, print_checks, run_checks

__all__ = ["run_checks", "check_case", "print_checks", "main", "all_checks", "CHECK_NAMES"]

# the checks in the order they run: (name, module, function name)
_REGISTRY = [
    ("00_environment", "gpucheck_env", "check_environment"),
    ("01_schedule_equivalence", "gpucheck_correct", "check_schedules"),
    ("02_engine_claim", "gpucheck_correct", "check_engine_claim"),
    ("03_parity_torch_adamw", "gpucheck_correct", "check_parity"),
    ("04_tiers", "gpucheck_correct", "check_tiers"),
    ("05_moments", "gpucheck_correct", "check_moments"),
    ("06_accumulation", "gpucheck_correct", "check_accumulation"),
    ("07_clipping", "gpucheck_amp", "check_clipping"),
    ("08_gradscaler", "gpucheck_amp", "check_gradscaler"),
    ("09_bf16_autocast", "gpucheck_amp", "check_bf16_autocast"),
    ("10_release_grads", "gpucheck_amp", "check_release_grads"),
    ("11_small_params", "gpucheck_amp", "check_small_params"),
    ("12_user_writes", "gpucheck_writes", "check_user_writes"),
    ("13_non_owner_reads", "gpucheck_writes", "check_non_owner_reads"),
    ("14_torch_compile", "gpucheck_writes", "check_compile"),
    ("15_user_stream", "gpucheck_writes", "check_user_stream"),
    ("16_fsdp2", "gpucheck_dist", "check_fsdp2"),
    ("17_ddp", "gpucheck_dist", "check_ddp"),
    ("18_robustness", "gpucheck_dist", "check_robustness"),
    ("19_delayed_updates", "gpucheck_delayed", "check_delayed"),
    ("20_two_ranks", "gpucheck_ranks", "check_ranks"),
    ("perf_setup", "gpucheck_perf", "perf_setup"),
    ("perf_baseline", "gpucheck_perf", "perf_baseline"),
    ("perf_torch_fused", "gpucheck_perf", "perf_torch_fused"),
    ("perf_offload_eager", "gpucheck_perf", "perf_eager"),
    ("perf_offload_deferred_clip", "gpucheck_perf", "perf_clip"),
    ("perf_offload_sync", "gpucheck_perf", "perf_sync"),
    ("perf_offload_nvme", "gpucheck_perf", "perf_nvme"),
    ("perf_offload_8bit", "gpucheck_perf", "perf_8bit"),
    ("perf_offload_delayed", "gpucheck_perf", "perf_delayed"),
    ("perf_profiler", "gpucheck_perf", "perf_profiler"),
    ("perf_thread_sweep", "gpucheck_perf", "perf_threads"),
    ("perf_bucket_sweep", "gpucheck_perf", "perf_buckets"),
    ("perf_fingerprint_cost", "gpucheck_perf", "perf_fingerprints"),
    ("perf_memory_vs_plan", "gpucheck_perf", "perf_memory"),
    ("perf_trace_lanes", "gpucheck_perf", "perf_trace"),
    ("perf_peers", "gpucheck_perf", "perf_peers"),
    ("perf_summary", "gpucheck_perf", "perf_summary"),
]
CHECK_NAMES = [n for n, _, _ in _REGISTRY]
QUICK_PERF = {"perf_setup", "perf_baseline", "perf_offload_eager", "perf_summary"}


def all_checks():
    import importlib
    out = []
    for name, mod, fn in _REGISTRY:
        try:
            out.append((name, getattr(importlib.import_module(f"offload.bench.{mod}"), fn)))
        # a broken module is that check's FAIL, not the script's end
        except Exception as e:  # noqa: BLE001
            out.append((name, _broken(f"offload.bench.{mod}.{fn}", e)))
    return out


def _broken(where: str, err: BaseException):
    def fn(ctx, res):
        raise RuntimeError(f"could not load {where}: {type(err).__name__}: {err}")
    return fn


class Runner:
    def __init__(self, ctx: Ctx, out_path: str, inject_fail=()):
        self.ctx = ctx
        self.out_path = out_path
        self.inject_fail = set(inject_fail)
        self.results: List[dict] = []
        self._current = None   # (name, started, hard limit) of the running check
        self._lock = threading.Lock()
        self._fh = open(out_path, "a")
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="gpu-check-watchdog", daemon=True).start()

    # -------------------------------------------------------------- output
    def _emit(self, rec: dict) -> None:
        with self._lock:
            self.results.append(rec)
            self._fh.write(json.dumps(rec, default=str) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
            detail = rec["detail"].replace("\n", " ")
            print(f"{rec['verdict']:<4}  {rec['name']}  {detail}  ({rec['seconds']:.1f} s)",
                  flush=True)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            cur = self._current
            if cur is None or time.time() < cur[2]:
                continue
            name, t0, _ = cur
            sys.stderr.write(f"\ngpu_check: {name} hung ({time.time() - t0:.0f} s); stacks of "
                             "every thread:\n")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._emit(dict(name=name, verdict="FAIL", seconds=time.time() - t0,
                            detail="hung: ran far past its time budget; the watchdog ended the "
                                   "script (stacks on stderr)", data={}, device=self.ctx.kind))
            self.summary()
            sys.stdout.flush()
            try:
                self.ctx.teardown()   # the temp dir of the NVMe/mmap state
            except Exception:  # noqa: BLE001
                pass
            os._exit(1)

    # -------------------------------------------------------------- running
    def run_one(self, name: str, fn) -> dict:
        ctx = self.ctx
        budget = ctx.budget_of(name)
        left = ctx.global_deadline - time.time()
        res = Result(name)
        t0 = time.time()
        if budget is None:
            res.skip("not run in --quick mode")
        elif left < budget:
            res.skip(f"needs ~{budget:.0f} s, {max(left, 0):.0f} s left of --budget-s")
        else:
            ctx.check_deadline, ctx.check_budget = t0 + budget, budget
            self._current = (name, t0, t0 + max(3 * budget, budget + 60))
            try:
                if name in self.inject_fail:
                    raise RuntimeError("failure injected by --inject-fail")
                with ctx.section(name):
                    fn(ctx, res)
            except Skip as e:
                res.skip(str(e))
            except Exception as e:  # a check that raises is a FAIL, never the end of the script
                res.error(e, traceback.format_exc(limit=8))
            finally:
                try:
                    ctx.cleanup(res)
                finally:
                    self._current = None
        rec = res.record(time.time() - t0, budget, ctx.kind)
        self._emit(rec)
        return rec

    def run(self, checks) -> None:
        for name, fn in checks:
            self.run_one(name, fn)

    def summary(self) -> int:
        counts = {v: sum(r["verdict"] == v for r in self.results)
                  for v in ("PASS", "FAIL", "SKIP", "INFO")}
        print(f"\nsummary: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP, "
              f"{counts['INFO']} INFO in {time.time() - self.ctx.t_start:.0f} s; JSON lines in "
              f"{self.out_path}", flush=True)
        for r in self.results:
            if r["verdict"] == "FAIL":
                print(f"  FAIL {r['name']}: {r['detail'][:300]}", flush=True)
        return 1 if counts["FAIL"] else 0

    def close(self) -> None:
        self._stop.set()
        self._fh.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_check.py",
                                description="Correctness and timing of GPU offload on one "
                                            "device, fail-soft.")
    p.add_argument("--device", choices=["cuda", "fake"], default="cuda",
                   help="cuda (default) or fake: the same checks on the CPU through "
                        "offload's FakeDevice")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, fewer steps, perf reduced to one variant")
    p.add_argument("--budget-s", dest="budget_s", type=float, default=None,
                   help="global time budget in seconds (default: 480 on CUDA, 170 fake, "
                        "40 fake --quick)")
    p.add_argument("--out", default=None,
                   help="JSON lines file (default: $OUT/gpu_check.jsonl, else a temp dir)")
    p.add_argument("--only", default=None, help="comma-separated check names (or prefixes) to run")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per correctness case")
    p.add_argument("--perf-preset", dest="perf_preset", default=None,
                   help="GPT preset of the performance section (offload/bench/gpt.py; default "
                        "350m on CUDA, tiny fake)")
    p.add_argument("--nvme-dir", dest="nvme_dir", default=None,
                   help="directory on a real disk for the NVMe/mmap state (default: a temp "
                        "dir under the cwd)")
    p.add_argument("--inject-fail", dest="inject_fail", default="", help=argparse.SUPPRESS)
    return p


def _out_path(arg) -> str:
    if arg:
        return arg
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        return os.path.join(os.environ["OUT"], "gpu_check.jsonl")
    return os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "gpu_check.jsonl")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device in this process (torch %s, cuda %s): nothing to check "
              "here. Run it on a machine with a GPU, or use --device fake for the CPU run of "
              "the same checks."
              % (torch.__version__, torch.version.cuda))
        return 0
    ctx = Ctx(args)
    out = _out_path(args.out)
    ctx.out_dir = os.path.dirname(os.path.abspath(out))
    print(f"gpu_check: device {ctx.kind}{' (quick)' if ctx.quick else ''}, budget "
          f"{ctx.budget_s:.0f} s, JSON lines -> {out}", flush=True)
    checks = all_checks()
    if args.only:
        want = [w.strip() for w in args.only.split(",") if w.strip()]
        checks = [(n, f) for n, f in checks if any(n.startswith(w) for w in want)]
    runner = Runner(ctx, out, inject_fail=[s for s in args.inject_fail.split(",") if s])
    try:
        ctx.setup()
        runner.run(checks)
        rc = runner.summary()
    finally:
        runner.close()
        ctx.teardown()
    return rc
