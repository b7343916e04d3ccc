"""gpu_check.py: one command for a machine with one GPU (< 5 min): GPU-offload correctness against
torch.optim.AdamW on the GPU, then the timing table of ``python -m offload.bench train``.

    python bench/gpu_check.py                 # on a CUDA machine
    python bench/gpu_check.py --device fake   # the same checks on CPU through the fake device

Without CUDA (and without --device fake) it says so and exits 0. Exit code 1 if a check fails.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "fake"], default="cuda")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per correctness case")
    p.add_argument("--no-bench", action="store_true", help="correctness only")
    p.add_argument("--preset", default="125m", help="model of the timing table (see offload/bench/gpt.py)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--json", default=None, help="write checks and timings as JSON")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device in this process (torch %s, cuda %s): nothing to check here. "
              "Run it on a machine with a GPU, or use --device fake for the CPU run of the same checks."
              % (torch.__version__, torch.version.cuda))
        return 0
    import offload
    from offload.bench import gpucheck, train
    t0 = time.time()
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, offload {offload.build_info()}")
    results = gpucheck.run_checks(args.device, steps=args.steps)
    print("correctness vs torch.optim.AdamW on the same device "
          "(|d| = L2 distance ours-reference over all params; rel = |d| / how far the reference moved):")
    gpucheck.print_checks(results)
    out = {"checks": results}
    if not args.no_bench:
        ns = argparse.Namespace(device="cuda" if args.device == "cuda" else "cpu",
                                preset=args.preset if args.device == "cuda" else "small", seq=None,
                                batch=args.batch if args.device == "cuda" else 2, dtype="bf16",
                                bucket_mb=32.0 if args.device == "cuda" else 1.0, steps=5, reps=3, warmup=2,
                                lr=1e-4, variants="torch-fused,offload-overlap,offload-clip,offload-sync,offload-nvme",
                                trace=None, json=None)
        bench = train.run(ns)
        print()
        train.print_table(bench)
        out["train"] = bench
    print(f"\ngpu_check finished in {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    failed = [r for r in results if not r["ok"]]
    if failed:
        print(f"FAILED: {len(failed)} correctness case(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
