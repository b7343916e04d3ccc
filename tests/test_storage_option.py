"""tests/test_storage_option.py: storage= names where the optimizer state lives; state= (its old name, shared
with Optimizer.state) and the planner's nvme_path= still work for one release, with a DeprecationWarning
that points at the caller's line; the CLIs take --storage and --nvme-dir and still the old flags."""
import warnings

import pytest
import torch

import offload
from offload.bench.__main__ import build_parser


def _params():
    return [torch.nn.Parameter(torch.randn(300))]


@pytest.mark.parametrize("where", ["nvme", "mmap"])
def test_storage_puts_the_state_in_a_file(tmp_path, where):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)   # the new spelling warns about nothing
        opt = offload.AdamW(_params(), storage=where, nvme_dir=tmp_path)
    try:
        assert opt.storage_info()["path"].startswith(str(tmp_path))
    finally:
        opt.close()


def test_state_is_the_deprecated_name(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"state='nvme' is deprecated: .*\(storage='nvme'\)") as rec:
        opt = offload.Adam(_params(), state="nvme", nvme_dir=tmp_path)
    assert rec[0].filename == __file__            # the warning names the caller's line
    assert opt.storage_info()["file_bytes"] > 0
    opt.close()
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass storage= only"):
        offload.AdamW(_params(), storage="ram", state="nvme", nvme_dir=tmp_path)
    with pytest.raises(ValueError, match="storage is an option of the whole optimizer"):
        offload.AdamW([{"params": _params(), "storage": "nvme"}])


def test_planner_spellings(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = offload.plan(10_000, device="cpu", storage="nvme", nvme_dir=str(tmp_path))
        assert offload.plan(10_000, device="cpu", nvme_dir=str(tmp_path)).config["state"] == "nvme"   # as the optimizer
    with pytest.warns(DeprecationWarning, match="nvme_path=.* nvme_dir") as rec:
        old = offload.plan(10_000, device="cpu", state="nvme", nvme_path=str(tmp_path))
    assert {str(w.message).split(" ")[0] for w in rec} == {"plan(nvme_path=...)", "state='nvme'"}
    assert all(w.filename == __file__ for w in rec)
    assert old.rows == new.rows


def test_cli_flags_new_and_old():
    parser = build_parser()
    for cmd, flag, dest, value in (("plan", "--storage", "storage", "nvme"), ("plan", "--state", "storage", "nvme"),
                                   ("plan", "--nvme-dir", "nvme_dir", "/x"), ("plan", "--nvme-path", "nvme_dir", "/x"),
                                   ("step", "--storage", "state", "mmap"), ("step", "--state", "state", "mmap"),
                                   ("step", "--nvme-dir", "dir", "/x"), ("step", "--dir", "dir", "/x"),
                                   ("io", "--nvme-dir", "dir", "/x"), ("io", "--dir", "dir", "/x"),
                                   ("train", "--storage", "state", "nvme"), ("train", "--state", "state", "nvme"),
                                   ("train", "--nvme-dir", "nvme_dir", "/x")):
        extra = ["--params", "1M"] if cmd == "plan" else []
        assert getattr(parser.parse_args([cmd, flag, value] + extra), dest) == value, (cmd, flag)
    assert parser.parse_args(["step"]).state == "nvme" and parser.parse_args(["plan", "--params", "1M"]).storage is None
    import argparse
    from offload.bench import plan as bench_plan
    sub = argparse.ArgumentParser().add_subparsers()
    bench_plan.add_parser(sub)
    help_text = sub.choices["plan"].format_help()
    assert "--storage" in help_text and "--nvme-dir" in help_text
    assert "--state" not in help_text and "--nvme-path" not in help_text   # the old flags are hidden aliases
