"""test_moment_codes.py: compressed moments' byte code is versioned (offload/moments/format.py CODE_VERSIONS).

A checkpoint stores compressed moments as the kernel's bytes. If a later kernel encodes the same
values to other bytes, loading an old checkpoint would silently decode to wrong moments. So:
  * the bytes each format produces for a fixed run are pinned here per code version: a change of
    the encoder fails this test until CODE_VERSIONS is bumped (and the digest updated);
  * offload.save records the versions in the rank index; offload.load refuses another version
    with a message naming it, and treats an index without the field as version 1.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os

import pytest
import torch

import offload
from offload.moments import format as mformat
from offload.checkpoint import CheckpointError

# sha256 of the compressed tensors (sorted keys, raw bytes) after _run(); one entry per code version
DIGESTS = {
    ("bf16", 1): "ebe985ff02957f2b505360bd0e00e43f957c98711f56ced5c2dbe78ca98176f7",
    ("8bit", 1): "12e4d42b0e7f7604b9ed4f40013555bd67c3f1003abbadabdc4ffa29964c56dc",
}


def _run(fmt: str):
    g = torch.Generator().manual_seed(11)
    p = torch.randn(4096 + 300, generator=g)
    opt = offload.AdamW([p], lr=1e-2, weight_decay=0.1, moments=fmt)
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
    return opt, p


def _digest(opt) -> str:
    h = hashlib.sha256()
    for ref in sorted(opt.checkpoint_tensors(None), key=lambda r: r.key):
        if mformat.parse_saved_key(ref.key):
            h.update(ref.key.encode())
            for chunk in ref.read_chunks(1 << 20):
                h.update(chunk.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_code_bytes_are_pinned_per_version(fmt):
    opt, _ = _run(fmt)
    want = DIGESTS.get((fmt, mformat.CODE_VERSIONS[fmt]))
    got = _digest(opt)
    assert want == got, (f"the {fmt} moment bytes changed (digest {got}): if the encoder changed on purpose, bump "
                         f"offload/moments/format.py CODE_VERSIONS[{fmt!r}] and add the new digest here; old checkpoints "
                         f"are then refused instead of decoded wrongly")


def _rank_index(d: str) -> str:
    found = [f for f in glob.glob(os.path.join(d, "**", "*.json"), recursive=True)
             if json.load(open(f)).get("format") == "offload-checkpoint-rank"]
    assert len(found) == 1, found
    return found[0]


def test_save_records_code_and_load_checks_it(tmp_path, monkeypatch):
    opt, p = _run("8bit")
    offload.save(opt, str(tmp_path / "ck"))
    ridx = json.load(open(_rank_index(str(tmp_path / "ck"))))
    assert ridx["moment_codes"] == {"8bit": mformat.CODE_VERSIONS["8bit"]}
    # same version: resumes bitwise
    other = offload.AdamW([p.detach().clone()], lr=1e-2, weight_decay=0.1, moments="8bit")
    offload.load(other, str(tmp_path / "ck"))
    assert _digest(other) == _digest(opt)
    # a newer offload with another code: refused, naming the versions
    monkeypatch.setitem(mformat.CODE_VERSIONS, "8bit", mformat.CODE_VERSIONS["8bit"] + 1)
    third = offload.AdamW([p.detach().clone()], lr=1e-2, weight_decay=0.1, moments="8bit")
    with pytest.raises(CheckpointError, match="byte code version 1, this offload decodes version 2"):
        offload.load(third, str(tmp_path / "ck"))


def test_fp32_checkpoint_records_no_codes(tmp_path):
    p = torch.randn(64)
    opt = offload.AdamW([p], lr=1e-3, moments="fp32")
    p.grad = torch.randn(64)
    opt.step()
    offload.save(opt, str(tmp_path / "ck"))
    assert json.load(open(_rank_index(str(tmp_path / "ck"))))["moment_codes"] == {}


@pytest.mark.parametrize("state", ["ram", "mmap"])
def test_save_never_decodes_compressed_moments(tmp_path, monkeypatch, state):
    """offload.save stores the compressed bytes; decoding them (a transient fp32 copy of every
    moment) would defeat bounded memory with large NVMe/mmap states."""
    kw = dict(storage=state, nvme_dir=str(tmp_path)) if state != "ram" else {}
    g = torch.Generator().manual_seed(3)
    p = torch.randn(4096 + 300, generator=g)
    opt = offload.AdamW([p], lr=1e-2, moments="8bit", **kw)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    want = _digest(opt)

    def no_decode(*a, **k):
        raise AssertionError("offload.save decoded the compressed moments")
    with monkeypatch.context() as m:
        m.setattr(mformat.moment_format("8bit"), "decode", no_decode)
        offload.save(opt, str(tmp_path / "ck"))
    other = offload.AdamW([p.detach().clone()], lr=1e-2, moments="8bit")
    offload.load(other, str(tmp_path / "ck"))
    assert _digest(other) == want
    assert other.state[other.param_groups[0]["params"][0]]["step"] == 2
