"""The examples in examples/ run on CPU with their --tiny defaults and actually learn."""
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _losses(text):
    return [float(m) for m in re.findall(r"loss ([0-9.]+)", text)]


@pytest.mark.timeout(60)
def test_train_loop_learns_and_resumes(tmp_path, capsys):
    mod = _load("train_loop")
    ck = str(tmp_path / "run")
    final = mod.main(["--steps", "40", "--ckpt", ck, "--save-every", "20"])
    losses = _losses(capsys.readouterr().out)
    assert losses[0] > 3.0 and final < 0.6 * losses[0]
    assert sorted(os.listdir(ck)) == ["loop.json", "model.safetensors", "optim"]
    again = mod.main(["--steps", "45", "--ckpt", ck, "--resume"])
    out = capsys.readouterr().out
    assert "resumed at step 40" in out and math.isfinite(again) and again < 0.6 * losses[0]


@pytest.mark.timeout(90)
def test_fsdp2_example_runs_two_processes(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "fsdp2.py"), "--steps", "20",
                          "--save", str(tmp_path / "ck")], env=env, capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(out.stdout)
    assert len(losses) >= 3 and losses[-1] < losses[0]
    assert sum(f.endswith(".safetensors") for f in os.listdir(tmp_path / "ck")) == 2


@pytest.mark.timeout(90)
def test_hf_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    losses = _load("hf_trainer").main(["--steps", "24", "--output-dir", str(tmp_path)])
    assert len(losses) >= 4 and losses[-1] < 0.8 * losses[0]
