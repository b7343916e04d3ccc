# test_bench.py: the benchmark CLI runs end to end on a tiny size and writes what it promises
# (table, targets, JSON). Speed is judged by the benchmark itself, never here.
import json
import subprocess
import sys

import pytest


def test_kernel_bench_tiny_run_writes_json(tmp_path):
    out = tmp_path / "not_yet_there" / "k.json"  # the folder is created
    r = subprocess.run([sys.executable, "-m", "offload.bench", "kernel", "--scale", "0.0005", "--reps", "1",
                        "--threads", "1", "--no-deepspeed", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("CPU: ") and "kernel ISA: " in first  # machine class first (issue 11)
    assert "bandwidth probe (ceiling)" in r.stdout and "torch AdamW(fused=True)" in r.stdout
    assert "speed targets (PASS" in r.stdout and "verdict (median step times" in r.stdout
    data = json.loads(out.read_text())
    assert data["verdicts"] and all(v["peer"].startswith("torch") and v["speedup"] > 0 for v in data["verdicts"])
    impls = {row["impl"] for row in data["results"]}
    assert {"offload.AdamW.step", "offload kernel call", "torch AdamW(fused=True)",
            "torch AdamW(foreach=True)", "bandwidth probe (ceiling)"} <= impls
    cases = {row["case"] for row in data["results"]}
    avx512 = "avx512" in data["build"]["available_isas"]
    assert len(cases) == 5 + avx512  # flat, multi, small, bf16, compressed moments (+ avx2 vs avx512)
    assert {"bf16 moments, fp32 grad", "8bit moments, bf16 grad+out"} <= impls
    assert "floor: 3 torch reads per tensor" in impls  # the many-tensor case's floor (issue 11)
    mom = [row for row in data["results"] if row["case"] == "moments"]
    assert mom and all(row["pct_of_own_probe"] > 0 and row["probe_speedup_vs_fp32_streams"] > 0 for row in mom)
    assert "of its own streams' probe" in r.stdout
    assert all(row["seconds"] > 0 for row in data["results"])
    assert data["targets"] and data["target_definitions"]
    if avx512:  # "is AVX-512 worth it?": forced avx2 vs native in the same run
        assert {"offload kernel call [avx2]", "offload kernel call [avx512]"} <= impls
    else:
        assert "no AVX-512" in data["isa_case"] and "no AVX-512" in r.stdout


def test_paired_ratio_is_the_median_of_per_round_ratios():
    import pytest
    from offload.bench.common import paired_ratio
    # the second round is slow for both: a ratio of medians would say 4/2.5, pairing says 2
    assert paired_ratio([2.0, 8.0, 4.0], [1.0, 4.0, 2.5]) == 2.0
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([1.0], [1.0, 2.0])


def test_unwritable_result_paths_are_refused_before_the_run(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    cases = (("--json", blocker / "k.json"), ("--json", tmp_path), ("--plot", blocker / "p.png"))
    # one interpreter runs the bench's command line for each case (importing torch once, not three times)
    code = ("import sys, json\nfrom offload.bench.__main__ import main\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        main(argv)\n        print('RC 0', file=sys.stderr, flush=True)\n"
            "    except SystemExit as e:\n        print(f'RC {e.code}', file=sys.stderr, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code, json.dumps([["kernel", f, str(p)] for f, p in cases])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    parts = r.stderr.split("RC ")
    assert len(parts) == len(cases) + 1, r.stderr
    for (flag, path), before, after in zip(cases, parts[:-1], parts[1:]):
        assert after.startswith("2") and f"{flag} {path}" in before, r.stderr
    assert "CPU: " not in r.stdout  # nothing was measured
    assert blocker.read_text() == "mine"


def test_kernel_bench_rejects_unknown_case():
    r = subprocess.run([sys.executable, "-m", "offload.bench", "kernel", "--cases", "flat,nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "nope" in r.stderr


def test_io_bench_takes_the_common_options():
    """--reps/--json/--no-progress mean the same in every subcommand (io refused --no-progress)."""
    import argparse
    from offload.bench import io as bench_io, kernel as bench_kernel  # not train: it binds sys.stdout at import
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench_kernel.add_parser(sub)
    bench_io.add_parser(sub)
    for cmd in ("kernel", "io"):
        args = parser.parse_args([cmd, "--no-progress", "--reps", "2", "--json", "x.json"])
        assert args.no_progress and args.reps == 2 and args.json == "x.json"


def test_every_measuring_subcommand_accepts_no_progress():
    """A script passing --no-progress to each subcommand must not die on `step` or `train`."""
    from offload.bench.__main__ import build_parser
    parser = build_parser()
    for cmd in ("kernel", "io", "step", "train", "fidelity"):
        assert parser.parse_args([cmd, "--no-progress", "--json", "x.json"]).no_progress, cmd


def test_bench_default_subcommand_is_kernel():
    r = subprocess.run([sys.executable, "-m", "offload.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "kernel" in r.stdout


def test_verdict_lines():
    """One helper words every benchmark's verdict: against the fastest peer, or against a ceiling."""
    from offload.bench.common import verdict
    from offload.bench.train import train_verdict
    v = verdict(1.0, {"torch": 1.5, "ds": 2.0, "none": None})            # times: lower is better
    assert v["peer"] == "torch" and v["speedup"] == 1.5 and v["line"].endswith("(torch): offload faster")
    assert verdict(2.0, {"a": 1.0, "b": 1.5}, higher_is_better=True)["line"].endswith("(b): offload faster")
    assert "even (within 2 %)" in verdict(1.0, {"a": 1.01})["line"]
    assert verdict(1.0, {}) is None
    c = verdict(1.1, {"io only": 1.0}, ceiling=True, ours_name="the step")
    assert c["speedup"] == pytest.approx(1.1) and c["line"].endswith("takes 1.10x its ceiling (io only): 10 % over it")
    assert verdict(0.5, {"fio": 1.0}, higher_is_better=True, ceiling=True)["line"].endswith("50 % under it")
    rows = [dict(variant="torch-fused", iter_s=0.2), dict(variant="offload-sync", iter_s=0.3),
            dict(variant="offload-overlap", iter_s=0.25), dict(variant="offload-clip", error="x")]
    t = train_verdict(rows)
    assert t["peer"] == "torch-fused" and t["speedup"] == pytest.approx(0.8) and "offload-overlap" in t["line"]
    assert train_verdict(rows[1:]) is None and train_verdict(rows[:1]) is None


def test_kernel_targets_say_where_a_miss_comes_from():
    """A step under 95 % of the ceiling names its kernel call's share; a bf16 loss to DeepSpeed says that
    DeepSpeed moves fewer bytes (no fp32 master); a pass carries no note."""
    from offload.bench.kernel import check_targets
    from offload.bench.kernel_cases import Case

    def case(key, sizes, lowp, step, kern, ds):
        c = Case(key, sizes, lowp=lowp)
        raw = {"bandwidth probe (ceiling)": [1.0] * 3, "offload.AdamW.step": [step] * 3,
               "offload kernel call": [kern] * 3, "torch AdamW(fused=True)": [2.0] * 3, "DeepSpeedCPUAdam": [ds] * 3}
        c.results[1] = {"_raw": raw, **{k: v[0] for k, v in raw.items()}}
        return c

    lines = check_targets([case("multi", [8] * 4, False, 1.25, 1.02, 1.5), case("bf16", [32], True, 1.04, 1.01, 0.95),
                           case("flat", [32], False, 1.0, 0.98, 1.2)], [1])
    assert "MISS  fp32 4x8, 1 thr: step time vs the memory's best (>= 95%): 80.0% (the kernel call on the same " \
           "tensors: 98%; the rest is the step's checks of 4 tensors)" in lines
    bf16 = [x for x in lines if x.startswith("MISS  bf16") and "fastest peer" in x]
    assert len(bf16) == 1 and "0.91x (DeepSpeedCPUAdam updates the bf16 weights in place, with no fp32 master " \
        "copy: it moves 22 B per parameter, offload 30 B)" in bf16[0]
    assert [x for x in lines if x.startswith("PASS  fp32 flat")] == [
        "PASS  fp32 flat 32, 1 thr: step time vs the memory's best (>= 95%): 100.0%",
        "PASS  fp32 flat 32, 1 thr: against the fastest peer, DeepSpeedCPUAdam (>= 1.0x): 1.20x"]


@pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)
@pytest.mark.timeout(120)
def test_train_bench_runs_on_cpu(tmp_path, capsys):
    import json
    from offload.bench import train
    out = tmp_path / "t.json"
    assert train.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--reps", "1", "--warmup", "1",
                       "--bucket-mb", "0.01", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fake device" in text and "offload-overlap" in text
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert res["offload-overlap"]["iter_s"] > 0 and res["offload-sync"]["exposed_s"] is not None
    assert "offload-nvme" not in res   # only with --state nvme|mmap
    assert train.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--reps", "1", "--warmup", "1",
                       "--bucket-mb", "0.01", "--state", "nvme", "--nvme-dir", str(tmp_path), "--host-budget", "1MiB",
                       "--variants", "offload-nvme", "--json", str(out)]) == 0
    nv = json.loads(out.read_text())["results"][0]
    assert nv["variant"] == "offload-nvme" and nv["bound"] > 0 and nv["io_s"] > 0 and nv["host_bytes"] <= 2**20
    assert "target <= 1.15" in capsys.readouterr().out


def test_kernel_call_contender_does_the_steps_work_on_bf16_parameters():
    """The bench's raw kernel call on bf16 parameters does what the step does: it also takes the
    user's writes to the parameter since the last step (so it is timed doing the same work)."""
    import torch
    from offload.bench.kernel_cases import Case, Ours, OursKernel
    torch.manual_seed(0)
    case = Case("bf16", [1000, 37], lowp=True)
    ours = Ours(case, [torch.randn(n).bfloat16() for n in case.sizes], 1)
    ours.step()   # state exists from here
    kernel = OursKernel(ours, 1)
    before = ours.params[0].detach().clone()
    ours.params[0].data[5:9] = 3.0   # a write through .data: the step adopts it into its master
    kernel.step()
    after = ours.params[0].float()
    assert (after[5:9] - 3.0).abs().max() < 0.05   # updated from the written value, not the old master
    assert (after[9:] - before[9:].float()).abs().max() < 0.05


def test_bf16_case_ceiling_walks_the_streams_its_step_moves():
    """The bf16 case's ceiling moves what its step moves (fp32 p, m, v read and written, the bf16 gradient
    read, the bf16 parameter read and written: 30 B/param), in every way of walking memory it times."""
    import torch
    from offload.bench.kernel_cases import BYTES_PER_PARAM_BF16, Case, probe_modes
    case = Case("bf16", [4099], lowp=True)
    assert case.bytes_per_param == BYTES_PER_PARAM_BF16 == 30 and Case("flat", [10]).bytes_per_param == 28
    probes = probe_modes(case.numel, 2, lowp=True)
    assert len(probes) > 1 and all(pr.bufs is probes[0].bufs for pr in probes)
    assert [t.dtype for t in probes[0].bufs] == [torch.float32] * 3 + [torch.bfloat16] * 2
    for pr in probes:
        before = [t.clone() for t in pr.bufs]
        pr.step()
        written = [not torch.equal(a, b) for a, b in zip(before, pr.bufs)]
        assert written == [True, True, True, False, True], pr.name   # p, m, v, (g read only), parameter


def test_kernel_bench_leaves_out_a_case_that_does_not_fit_in_memory():
    """A case whose tensors exceed the memory available is skipped with a line that says how much it needs
    and what --scale would fit, instead of the whole run being killed by the out-of-memory killer."""
    from offload.bench.kernel import cases_that_fit
    from offload.bench.kernel_cases import make_cases
    cases = make_cases(1.0, "flat,moments,isa", full=True)
    need = {c.key: c.footprint for c in cases}
    assert need["moments"] > need["flat"] > need["isa"] > 0
    avail = int(need["flat"] * 1.1) + 2**29 + 1  # room for flat, not for the moments case
    keep, notes = cases_that_fit(cases, avail, scale=1.0)
    assert [c.key for c in keep] == ["flat", "isa"]
    assert len(notes) == 1 and "compressed moments" in notes[0] and "--scale" in notes[0], notes
    scale = float(notes[0].split("--scale ")[1].split()[0])
    assert 0 < scale < 1 and make_cases(scale, "moments", full=True)[0].footprint * 1.1 + 2**29 <= avail
    assert cases_that_fit(cases, None)[0] == cases   # no figure (not Linux): nothing is left out


def test_moment_probes_share_one_set_of_streams_each_probe_moving_its_own():
    """Every probe of the moments case walks views of one set of regions (they run in turn: one set, not
    one per format), and within one probe the streams are disjoint, of the format's element sizes."""
    import torch
    from offload.bench.moments import _format_probes, probe_regions
    n = 3000
    regions = probe_regions(n)
    base = regions[0].untyped_storage().data_ptr()
    sizes = {"fp32": 4, "bf16": 2, "8bit": 1}
    for lowp in (False, True):
        for fmt in sizes:
            for pr in _format_probes(n, fmt, lowp, 1, regions):
                streams = [pr.p, pr.g, pr.m, pr.v] + ([pr.out] if lowp else [])
                assert all(t.untyped_storage().data_ptr() == base and t.numel() == n for t in streams)
                assert [t.element_size() for t in streams] == ([4, 2 if lowp else 4, sizes[fmt], sizes[fmt]]
                                                               + ([2] if lowp else []))
                spans = sorted((t.data_ptr(), t.data_ptr() + n * t.element_size()) for t in streams)
                assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (fmt, lowp)
                before = [t.clone() for t in streams]
                pr.step()
                changed = [not torch.equal(a, b) for a, b in zip(before, streams)]
                assert changed == [True, False, True, True] + ([True] if lowp else []), pr.name


def test_each_contender_is_timed_on_its_second_step_in_a_row():
    """time_warm times the second of two steps (each after prepare), not the first: a contender whose
    memory went untouched for a while is not timed cold while another is timed warm."""
    import time
    from offload.bench.common import time_warm

    class Cold:
        def __init__(self):
            self.calls = []

        def prepare(self):
            self.calls.append("prepare")

        def step(self):
            self.calls.append("step")
            time.sleep(0.2 if self.calls.count("step") == 1 else 0.0)

    c = Cold()
    assert time_warm(c) < 0.1 and c.calls == ["prepare", "step"] * 2

    class NoPrepare:
        steps = 0

        def step(self):
            self.steps += 1

    n = NoPrepare()
    time_warm(n)
    assert n.steps == 2
