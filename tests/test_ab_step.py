"""test_ab_step.py: tools/ab_step.py times the source trees it is given, whatever directory it runs
in and whichever tree is installed (editable): a worker checks where ``offload`` came from, and a
worker that stops is named."""
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_before_tree_is_the_one_timed(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(REPO / "offload", other / "offload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = other / "offload" / "__init__.py"   # a tree whose optimizer cannot be made
    init.write_text(init.read_text() + "\nAdamW = None\n")
    argv = [str(other), ".", "--cases", "one", "--threads", "1", "--rounds", "1", "--reps", "1"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "ab_step.py")] + argv, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and f"the worker for {other} stopped" in r.stderr, r.stdout + r.stderr
