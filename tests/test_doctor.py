# test_doctor.py: `python -m offload` / offload.doctor() (the environment report: its keys, the O_DIRECT
# probe, a directory left as it was) and the INFO lines on the "offload" logger (parameters stepped by
# torch's code, buffered instead of direct I/O, the setup chosen), silent unless logging is configured.
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload.doctor import KEYS, format_report

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=50, env=env, **kw)


def test_python_m_offload_json_has_the_documented_keys(tmp_path):
    r = _run(["-m", "offload", "--json", "--no-speed", "--dir", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert tuple(rep) == KEYS
    assert rep["offload"]["version"] == offload.__version__ and rep["offload"]["versions_match"] is True
    assert rep["offload"]["isa"] in rep["offload"]["available_isas"]
    assert rep["torch"]["version"] == torch.__version__
    assert rep["cuda"]["available"] == torch.cuda.is_available()
    assert rep["dir"]["path"] == os.path.realpath(tmp_path) and isinstance(rep["dir"]["o_direct"], bool)
    assert rep["memory"]["total_bytes"] > 0 and isinstance(rep["problems"], list)
    assert os.listdir(tmp_path) == []


def test_doctor_reports_o_direct_and_leaves_the_directory_as_it_was(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    before = sorted(os.listdir(tmp_path))
    rep = offload.doctor(dir=tmp_path)
    d = rep["dir"]
    assert isinstance(d["o_direct"], bool) and "error" not in d
    assert d["write_mb_s"] > 0 and d["read_mb_s"] > 0 and d["free_bytes"] > 0
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "mine.txt").read_text() == "keep me"
    text = format_report(rep)
    assert "O_DIRECT" in text and offload.__version__ in text


def test_doctor_names_a_directory_that_refuses_o_direct(tmp_path, no_o_direct):
    rep = offload.doctor(dir=tmp_path, speed_test=False)
    assert rep["dir"]["o_direct"] is False
    assert any("refuses O_DIRECT" in p for p in rep["problems"])
    assert os.listdir(tmp_path) == []


def test_doctor_names_a_missing_directory(tmp_path):
    rep = offload.doctor(dir=tmp_path / "nope", speed_test=False)
    assert "--dir" in rep["dir"]["error"] and rep["dir"]["o_direct"] is None


def test_a_float64_parameter_logs_the_fallback_once(caplog):
    caplog.set_level(logging.INFO, logger="offload")
    ps = [torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))]
    opt = offload.AdamW(ps, lr=0.1)
    assert any("stepped in place by the native kernel" in r.getMessage() and "host RAM" in r.getMessage()
               for r in caplog.records)
    for _ in range(2):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
    lines = [r.getMessage() for r in caplog.records if "torch's own Adam code" in r.getMessage()]
    assert lines == ["1 of 2 parameters are stepped by torch's own Adam code instead of offload's native kernel "
                     "(1 float64): same results as torch.optim, but slower; contiguous float32/bfloat16/float16 "
                     "parameters listed once use the native kernel"]
    assert all(r.levelno == logging.INFO and r.name.startswith("offload") for r in caplog.records)


def test_nvme_state_without_o_direct_logs_buffered_io(tmp_path, caplog, no_o_direct):
    caplog.set_level(logging.INFO, logger="offload")
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported"):
        opt = offload.AdamW([torch.nn.Parameter(torch.zeros(1000))], storage="nvme", nvme_dir=str(tmp_path))
    try:
        msgs = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"O_DIRECT is not supported in the NVMe state directory {tmp_path}") and
                   "buffered I/O" in m for m in msgs), msgs
        assert any("optimizer state in the file" in m and "(buffered I/O" in m for m in msgs), msgs
        assert opt.storage_info()["direct"] is False
    finally:
        opt.close()


def test_the_logger_is_silent_by_default(capfd, monkeypatch):
    """With no logging configured (no root handlers), nothing offload logs reaches stderr: its
    NullHandler keeps even a warning from Python's last-resort handler."""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("offload").handlers)
    reached = []

    class Recorder(logging.Handler):
        def emit(self, record):
            reached.append(record)
    monkeypatch.setattr(logging, "lastResort", Recorder())
    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers[:] = []   # as in a program that never configured logging (pytest's own handlers set aside)
    try:
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        opt = offload.AdamW([p])
        p.grad = torch.ones_like(p)
        opt.step()
        logging.getLogger("offload.state").warning("a warning nobody configured")
    finally:
        root.handlers[:] = saved
    assert reached == []
    out, err = capfd.readouterr()
    assert out == "" and err == ""
