"""gpu_check.py: the one command that checks and times GPU offload on one GPU, fail-soft, in <= 8 min.

    python bench/gpu_check.py                    # on a machine with CUDA (default --budget-s 480)
    python bench/gpu_check.py --device fake      # the same script end to end on the CPU (FakeDevice), ~3 min
    python bench/gpu_check.py --device fake --quick   # tiny sizes, perf reduced to one variant, ~45 s
    python bench/gpu_check.py --only 01,04,perf  # a subset (names or prefixes)

Each check has its own time budget and is skipped (SKIP, with the reason) when it does not fit in
what is left of --budget-s; an exception is a FAIL verdict, never the end of the script. After every
check one JSON line (name, verdict, seconds, detail, data) is appended to --out (default
$OUT/gpu_check.jsonl when OUT is set, else a temp dir; fsynced, so a killed run keeps its results)
and one line ``PASS|FAIL|SKIP|INFO  <name>  <detail>`` is printed. Exit code 1 if any check failed.
Without CUDA (and without --device fake) it says so and exits 0. The checks live in
offload/bench/gpucheck*.py.
"""
import os
import sys

# before torch initializes CUDA: deterministic cuBLAS for the bitwise sections
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload.bench.gpucheck import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
