"""tests/test_plan_refusals.py: every bad input of the planner is refused in one line that names
it: ``python -m offload.bench plan`` exits with status 2 and prints one line on stderr,
``offload.plan`` raises ValueError or TypeError with that line, both in well under a second; huge
but valid inputs finish quickly. tests/test_plan_fuzz.py throws random arguments at both."""
import json
import time

import pytest
import torch

import offload
from offload.bench.__main__ import main as bench_main

REFUSE_S = 1.0    # a refusal is argument checking only: well under a second
HUGE_S = 30.0     # a huge valid plan at the planner's limits (2 s on a busy 2-core VM)

# (argv of python -m offload.bench plan; {tmp}: a fresh folder), a fragment of the line it prints
CLI_BAD = [
    ("--params inf", "argument --params: 'inf' is not a parameter count (a whole number >= 1"),
    ("--params nan", "argument --params: 'nan' is not a parameter count"),
    ("--params 1e400", "argument --params: '1e400' is more than one tensor holds"),
    ("--params -5", "argument --params: '-5' is not a parameter count"),
    ("--params 0", "argument --params: '0' is not a parameter count"),
    ("--params 1.5", "a whole number"),
    ("--params 8GiBB", "not a parameter count"),
    ("--params 1e19", "at most 9,223,372,036,854,775,807"),
    ("--transformer 32,4096", "argument --transformer: '32,4096': give LAYERS,HIDDEN,VOCAB"),
    ("--transformer 32,4096,32000,1", "give LAYERS,HIDDEN,VOCAB"),
    ("--transformer 32,-4096,32000", "give LAYERS,HIDDEN,VOCAB"),
    ("--transformer 0,4096,32000", "give LAYERS,HIDDEN,VOCAB"),
    ("--transformer a,b,c", "give LAYERS,HIDDEN,VOCAB"),
    ("--transformer 100000000,100000000,1", "at most 9,223,372,036,854,775,807"),
    ("--params 7B --activations-gb -100",
     "argument --activations-gb: '-100' is not a number of GiB >= 0"),
    ("--params 7B --activations-gb inf", "argument --activations-gb: 'inf'"),
    ("--params 7B --activations-gb nan", "argument --activations-gb: 'nan'"),
    ("--params 7B --device cuda --staging-slots -3",
     "staging_slots must be an int in [1, 64], got -3"),
    ("--params 7B --device cuda --staging-slots 0",
     "staging_slots must be an int in [1, 64], got 0"),
    ("--params 7B --device cuda --staging-slots 65",
     "staging_slots must be an int in [1, 64], got 65"),
    ("--params 1M --storage mmap --nvme-dir {tmp}/a,{tmp}/b",
     "keeps its state in one mapped file"),
    ("--params 1M --storage ram --nvme-dir {tmp}",
     "nvme_dir only applies to storage='nvme'"),
    ("--params 1M --param-dtype fp8", "invalid choice: 'fp8'"),
    ("--params 1M --grad-dtype fp8", "invalid choice: 'fp8'"),
    ("--params 1M --tensors 0", "argument --tensors: '0' is not a tensor count"),
    ("--params 1M --tensors -4", "argument --tensors: '-4' is not a tensor count"),
    ("--params 10 --tensors 100", "--tensors 100: more tensors than the 10 parameters"),
    ("--params 1e12 --tensors 1e8",
     "argument --tensors: 100,000,000 tensors: the planner lays out at most"),
    ("--hf-config {tmp} --tensors 4", "--tensors applies to --params and --transformer"),
    ("--params 1M --host-budget 8GiBB", "host_budget='8GiBB': cannot parse size"),
    ("--params 1M --host-budget=", "host_budget='': cannot parse size"),
    ("--params 1M --host-budget=-1GiB", "host_budget='-1GiB': cannot parse size"),
    ("--params 1M --host-budget 0", "host_budget='0': size must be positive"),
    ("--params 1M --bucket-mb nan", "argument --bucket-mb: 'nan' is not a positive number of MiB"),
    ("--params 1M --bucket-mb inf", "argument --bucket-mb: 'inf'"),
    ("--params 1M --bucket-mb 0", "argument --bucket-mb: '0'"),
    ("--params 1M --bucket-mb -1", "argument --bucket-mb: '-1'"),
    ("--params 1M --bucket-mb 1e-9",
     "argument --bucket-mb: '1e-9' is not a positive number of MiB (at least one byte)"),
    ("--params 1M --depth 0", "depth (buckets read ahead) must be an int in [1, 64], got 0"),
    ("--params 1M --depth 65", "depth (buckets read ahead) must be an int in [1, 64], got 65"),
    ("--params 1M --world-size 0", "world_size must be an int >= 1, got 0"),
    ("--params 1M --world-size -1", "world_size must be an int >= 1, got -1"),
    ("--params 1M --moments-min-size -1", "moments_min_size must be an int >= 0, got -1"),
    ("--params 1M --threads 0", "threads must be an int in [1, 1024] or None, got 0"),
    ("--params 1M --threads 5000", "threads must be an int in [1, 1024] or None, got 5000"),
    ("--params 1M --nvme-dir=", "names an empty path"),
    ("--params 1M --storage nvme --host-budget 4KiB", "host_budget='4KiB' is too small"),
    ("--params 1e15 --storage nvme", "would take 22,"),
    ("--params 1e15 --storage mmap", "raise host_budget"),
    ("--params 1M --from-json {tmp}/missing.json", "missing.json"),
    ("--params 1M --from-json {tmp}/notjson.json", "notjson.json: not JSON"),
    ("--params 1M --from-json {tmp}/list.json",
     "list.json: not a JSON of python -m offload.bench kernel or io"),
    ("--params 1M --from-json {tmp}/strings.json", "strings.json: kernel record 0"),
    ("--params 1M --from-json=", "argument --from-json: '' names no file"),
    ("--params 1M --amsgrad --moments bf16", "amsgrad=True is not supported with moments='bf16'"),
    ("--params 1M --json {tmp}/file.txt/p.json", "--json"),
    ("--params 1M --bogus", "unrecognized arguments: --bogus"),
    ("--params 1M --transformer 1,2,3", "not allowed with argument"),
    ("", "one of the arguments --params --transformer --hf-config is required"),
    ("--params 1M --depth abc", "invalid int value: 'abc'"),
    ("--hf-config {tmp}/nothing", "no config.json"),
]


def _files(tmp):
    (tmp / "notjson.json").write_text("{not json")
    (tmp / "list.json").write_text("[1, 2]")
    record = dict(case="bf16 grad+out, flat 1M", threads=1, impl="offload.AdamW.step",
                  seconds="fast", params=1000)
    (tmp / "strings.json").write_text(json.dumps({"results": [record]}))
    (tmp / "file.txt").write_text("a file, not a folder")
    for d in ("a", "b"):
        (tmp / d).mkdir()


def run_cli(argv, capsys):
    """(exit status, stdout, stderr, seconds) of python -m offload.bench plan ``argv``, run in
    this process."""
    capsys.readouterr()
    t = time.perf_counter()
    try:
        rc = bench_main(["plan"] + argv)
    except SystemExit as e:
        rc = e.code
    dt = time.perf_counter() - t
    out, err = capsys.readouterr()
    return rc, out, err, dt


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args,fragment", CLI_BAD, ids=[a or "nothing" for a, _ in CLI_BAD])
def test_cli_refuses_in_one_line(args, fragment, tmp_path, capsys):
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args.split()]
    rc, _, err, dt = run_cli(argv, capsys)
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m offload.bench plan: error: "), err
    assert fragment.replace("{tmp}", str(tmp_path)) in lines[0]
    assert dt < REFUSE_S, f"took {dt:.2f} s"


M = torch.nn.Linear(4, 3)
BAD = [   # (positional, keywords) -> exception type, a fragment of its message
    ((None,), {}, TypeError, "plan() takes a torch.nn.Module"),
    ((True,), {}, TypeError, "plan() takes a torch.nn.Module"),
    ((-5,), {}, ValueError, "parameter count must be a whole number >= 1, got -5"),
    ((0,), {}, ValueError, "got 0"),
    ((float("nan"),), {}, ValueError, "got nan"),
    ((float("inf"),), {}, ValueError, "got inf"),
    ((1.5,), {}, ValueError, "got 1.5"),
    ((2 ** 63,), {}, ValueError, "at most 9,223,372,036,854,775,807"),
    (("",), {}, ValueError, "an empty path"),
    (([],), {}, ValueError, "no parameters to plan"),
    ((torch.nn.ReLU(),), {}, ValueError, "no parameters to plan"),
    (([torch.ones(3), "x"],), {}, TypeError, "parameter 1 is a str, not a tensor"),
    (([{"lr": 1.0}],), {}, ValueError, "param group 0 has no 'params'"),
    ((torch.ones(3, 3),), {}, TypeError,
     "an iterable of Tensors or dicts, but got torch.FloatTensor"),
    (({torch.ones(3)},), {}, TypeError, "ordered collections"),
    (([torch.ones(3, dtype=torch.float64)],), {}, ValueError, "parameter 0 is torch.float64"),
    ((M,), dict(device="tpu"), ValueError, "device must be 'cpu' or 'cuda'"),
    ((M,), dict(device=""), ValueError, "device must be 'cpu' or 'cuda'"),
    ((M,), dict(device=5), TypeError, "device must be 'cpu' or 'cuda'"),
    ((M,), dict(param_dtype="fp8"), ValueError,
     "param_dtype must be one of 'fp32', 'bf16', 'fp16'"),
    ((M,), dict(grad_dtype=torch.float64), ValueError, "grad_dtype must be one of"),
    ((M,), dict(param_dtype=5), TypeError, "param_dtype must be one of"),
    ((M,), dict(storage="disk"), ValueError, "must be 'ram', 'nvme' or 'mmap', got 'disk'"),
    ((M,), dict(amsgrad="yes"), TypeError, "amsgrad must be True or False"),
    ((M,), dict(world_size=0), ValueError, "world_size must be an int >= 1, got 0"),
    ((M,), dict(world_size="4"), TypeError, "world_size must be an int >= 1, got '4'"),
    ((M,), dict(sharding="zero3"), ValueError, "sharding must be"),
    ((M,), dict(bucket_bytes=0), ValueError, "bucket_bytes must be an int >= 1, got 0"),
    ((M,), dict(bucket_bytes=float("nan")), TypeError,
     "bucket_bytes must be an int >= 1, got nan"),
    ((M,), dict(depth=0), ValueError,
     "depth (buckets read ahead) must be an int in [1, 64], got 0"),
    ((M,), dict(depth=2.0), ValueError,
     "depth (buckets read ahead) must be an int in [1, 64], got 2.0"),
    ((M,), dict(host_budget=None), TypeError, "host_budget=None: size must be an int or a string"),
    ((M,), dict(host_budget="8GiBB"), ValueError, "host_budget='8GiBB': cannot parse size"),
    ((M,), dict(device="cuda", staging_slots=-3), ValueError,
     "staging_slots must be an int in [1, 64], got -3"),
    ((M,), dict(staging_slots="3"), ValueError,
     "staging_slots must be an int in [1, 64], got '3'"),
    ((M,), dict(nvme_dir=""), ValueError, "names an empty path"),
    ((M,), dict(nvme_dir=5), TypeError, "nvme_dir="),
    ((M,), dict(storage="ram", nvme_dir="/tmp"), ValueError,
     "only applies to storage='nvme' or storage='mmap'"),
    ((M,), dict(storage="mmap", nvme_dir=["/tmp", "/var/tmp"]), ValueError, "one mapped file"),
    ((M,), dict(activation_bytes=-1), ValueError,
     "activation_bytes must be a number of bytes >= 0, got -1"),
    ((M,), dict(activation_bytes=float("inf")), ValueError,
     "activation_bytes must be a number of bytes >= 0"),
    ((M,), dict(activation_bytes="1GB"), TypeError,
     "activation_bytes must be a number of bytes >= 0"),
    ((M,), dict(verbose="no"), TypeError, "verbose must be True or False"),
    ((M,), dict(moments="fp8"), ValueError, "moments must be one of"),
    ((M,), dict(moments_min_size=-1), ValueError, "moments_min_size must be an int >= 0, got -1"),
    ((M,), dict(moments_min_size=True), ValueError,
     "moments_min_size must be an int >= 0, got True"),
    ((M,), dict(threads=0), ValueError, "threads must be an int in [1, 1024] or None, got 0"),
    ((M,), dict(suggest=None), TypeError, "suggest must be True or False"),
    ((M,), dict(bandwidths=5), TypeError, "bandwidths must be"),
    ((M,), dict(bandwidths=""), ValueError, "bandwidths='' names no file"),
    ((M,), dict(bandwidths={"kernel": -1.0}), ValueError,
     "bandwidth kernel must be a positive number"),
    ((M,), dict(bandwidths={"kernel": float("nan")}), ValueError,
     "bandwidth kernel must be a positive number"),
    ((M,), dict(bandwidths={"disk": 1e9}), TypeError, "bandwidths has no figure 'disk'"),
    ((M,), dict(bandwidths={"kernel": "fast"}), ValueError,
     "bandwidth kernel must be a positive number"),
    ((1e15,), dict(device="cpu", storage="nvme"), ValueError, "raise host_budget"),
    ((10 ** 18,), dict(device="cpu", storage="mmap", host_budget="1TiB"), ValueError,
     "raise host_budget"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pos,kw,exc,fragment", BAD,
                         ids=[f"{i}-{f[:30]}" for i, (_, _, _, f) in enumerate(BAD)])
def test_plan_refuses_by_name(pos, kw, exc, fragment):
    t = time.perf_counter()
    with pytest.raises(exc) as e:
        offload.plan(*pos, **kw)
    assert time.perf_counter() - t < REFUSE_S
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert type(e.value) in (ValueError, TypeError)   # not a subclass a caller's except misses


GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 100}
CONFIGS = [   # config.json text (GPT-2 sizes around a bad value) -> a fragment of the refusal
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ("{}", "has no model_type"),
    ('{"model_type": 5}', "has no model_type"),
    (json.dumps(dict(GPT2, n_embd=-64)), "n_embd = -64"),
    (json.dumps(dict(GPT2, n_embd="64")), "n_embd = '64'"),
    (json.dumps(dict(GPT2, n_layer=2.5)), "n_layer = 2.5"),
    (json.dumps(dict(GPT2, n_layer=10 ** 7)), "n_layer = 10,000,000"),
    (json.dumps(dict(GPT2, text_config=dict(hidden_size=None, n_head=True))), "n_head = True"),
    (json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "intermediate_size": -5, "vocab_size": 100}),
     "intermediate_size = -5"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text,fragment", CONFIGS)
def test_bad_config_json(text, fragment, tmp_path, capsys):
    (tmp_path / "config.json").write_text(text)
    t = time.perf_counter()
    with pytest.raises(ValueError) as e:
        offload.plan(tmp_path, device="cpu")
    assert time.perf_counter() - t < REFUSE_S      # found before transformers is imported
    msg = str(e.value)
    assert fragment in msg and str(tmp_path / "config.json") in msg and "\n" not in msg
    rc, _, err, _ = run_cli(["--hf-config", str(tmp_path)], capsys)
    assert rc == 2 and err.strip() == f"python -m offload.bench plan: error: {e.value}"


@pytest.mark.timeout(60)
def test_config_json_transformers_refuses(tmp_path):
    """What only transformers can tell (an unknown model type, a shape it cannot build) is one
    line too."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="not a config transformers can read") as e:
        offload.plan(tmp_path / "config.json", device="cpu")
    assert "\n" not in str(e.value)
    # a file of any name is read itself, never the config.json beside it
    (tmp_path / "mine.json").write_text(json.dumps(dict(GPT2, n_layer=1, n_embd=8, n_head=1,
                                                        vocab_size=10, n_positions=4)))
    assert offload.plan(tmp_path / "mine.json", device="cpu").config["tensors"] == 16


HUGE = [   # valid, huge: a plan (status 0 or 1: it fits or not), quickly
    "--params 1e15 --device cpu",
    "--params 1e15 --device cuda",
    "--params 1e15 --device cpu --storage nvme --host-budget 1024TiB",
    "--params 1e15 --device cuda --storage mmap --host-budget 1024TiB --moments 8bit",
    "--params 4T --device cpu --storage nvme",
    "--params 9223372036854775807 --device cpu --world-size 1000000 --sharding fsdp",
    "--transformer 1000,100000,1000000 --device cpu",
    "--params 1e12 --tensors 100000 --device cpu",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", HUGE)
def test_huge_valid_inputs_finish_quickly(args, capsys, tmp_path):
    rc, _, err, dt = run_cli(args.split() + ["--json", str(tmp_path / "p.json")], capsys)
    assert rc in (0, 1) and not err, err
    assert dt < HUGE_S, f"took {dt:.1f} s"
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert rows and all(r["bytes"] >= 0 for r in rows)


def test_plan_rows_never_negative():
    """Every row of a valid plan is a byte count >= 0 (a refused input never reaches them)."""
    p = offload.plan(M, device="cuda", storage="nvme", activation_bytes=0, staging_slots=1)
    assert p.rows and all(isinstance(r.bytes, int) and r.bytes >= 0 for r in p.rows)


NVME = dict(storage="nvme", nvme_dir="{a}")
SAME_RULE = [   # (offload.AdamW keywords, offload.plan keywords): both refused, in the same words
    (dict(storage="mmap", nvme_dir="{a},{b}"), dict(storage="mmap", nvme_dir="{a},{b}")),
    (dict(storage="ram", nvme_dir="{a}"), dict(storage="ram", nvme_dir="{a}")),
    (dict(NVME, nvme_options={"depth": 0}), dict(storage="nvme", depth=0)),
    (dict(NVME, nvme_options={"depth": 65}), dict(storage="nvme", depth=65)),
    (dict(NVME, host_budget=4096), dict(storage="nvme", host_budget=4096)),
    (dict(NVME, host_budget="8GiBB"), dict(storage="nvme", host_budget="8GiBB")),
    (dict(moments="8bit", moments_min_size=-1), dict(moments="8bit", moments_min_size=-1)),
    (dict(moments="bf16", amsgrad=True), dict(moments="bf16", amsgrad=True)),
    (dict(threads=0), dict(threads=0)),
    (dict(device=True, nvme_options={"staging_slots": 0}), dict(device="cuda", staging_slots=0)),
    (dict(NVME, device=True, host_budget=6 * 4096 - 1),
     dict(device="cuda", storage="nvme", host_budget=6 * 4096 - 1)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_kw,plan_kw", SAME_RULE)
def test_the_planner_refuses_what_the_optimizer_refuses(opt_kw, plan_kw, tmp_path):
    """One rule for both (offload/state/choice.py, state/tier.py, moments/format.py): the
    optimizer's message is the planner's, and the planner plans no setup the optimizer refuses."""
    from offload.device import FakeDevice
    for d in ("a", "b"):
        (tmp_path / d).mkdir()

    def filled(kw):
        return {k: v.format(a=tmp_path / "a", b=tmp_path / "b") if isinstance(v, str) else v
                for k, v in kw.items()}
    opt_kw, plan_kw = filled(opt_kw), filled(plan_kw)
    if opt_kw.pop("device", False):
        opt_kw["offload_device"] = FakeDevice()
    model = torch.nn.Linear(64, 64)
    with pytest.raises((ValueError, TypeError)) as opt_error:
        offload.AdamW(model.parameters(), **opt_kw).close()
    with pytest.raises(type(opt_error.value)) as plan_error:
        offload.plan(model, **dict({"device": "cpu"}, **plan_kw))
    theirs = str(opt_error.value)   # the planner names the argument of a size it cannot parse
    named = f"host_budget={plan_kw.get('host_budget')!r}: {theirs}"
    assert str(plan_error.value) in (theirs, named)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", [False, True])
def test_too_small_budget_names_the_smallest_that_works(device, tmp_path):
    """The optimizer and the planner name the same smallest host_budget, and it is enough."""
    from offload.device import FakeDevice
    model = torch.nn.Linear(64, 64)
    kw = dict(storage="nvme", nvme_dir=tmp_path, offload_device=FakeDevice() if device else None)
    with pytest.raises(ValueError, match="is too small") as e:
        offload.AdamW(model.parameters(), host_budget=4096, **kw)
    need = int(str(e.value).split("needs at least ")[1].split()[0])
    with pytest.raises(ValueError, match=f"needs at least {need} bytes"):
        offload.plan(model, device="cuda" if device else "cpu", storage="nvme", host_budget=4096)
    with pytest.raises(ValueError, match="is too small"):
        offload.AdamW(model.parameters(), host_budget=need - 1, **kw)
    offload.AdamW(model.parameters(), host_budget=need, **kw).close()
    offload.plan(model, device="cuda" if device else "cpu", storage="nvme", host_budget=need)
