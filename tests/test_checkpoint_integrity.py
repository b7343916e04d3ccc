"""test_checkpoint_integrity.py: a damaged, tampered or foreign checkpoint is refused with CheckpointError
and leaves the optimizer unchanged: bit flips, truncation, edited or malformed rank indexes and
index.json, wrong shapes, names outside the directory, symlinks, a FIFO; saves never delete files they
did not create."""
import json
import os
import random
import threading
import zlib

import pytest
import torch

import offload
from offload import CheckpointError
from checkpoint_util import _saved, assert_unchanged, data_file, make, snapshot, state_equal, train


def _corrupt_and_check(tmp_path, mutate, match):
    model, opt = make()
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    mutate(tmp_path)
    model2, opt2 = make()
    train(model2, opt2, 1, 0)
    before = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt2.state_dict()["state"].items()}
    with pytest.raises(CheckpointError, match=match):
        offload.load(opt2, tmp_path)
    after = opt2.state_dict()["state"]
    for k in before:  # a refused load leaves the optimizer untouched
        for kk in before[k]:
            assert torch.equal(before[k][kk], after[k][kk])


@pytest.mark.timeout(30)
def test_bit_flip_detected(tmp_path):
    def flip(d):
        path = data_file(d)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 37)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    _corrupt_and_check(tmp_path, flip, "checksum mismatch .* corrupted")


@pytest.mark.timeout(30)
def test_truncation_detected(tmp_path):
    def trunc(d):
        path = data_file(d)
        os.truncate(path, os.path.getsize(path) - 100)
    _corrupt_and_check(tmp_path, trunc, "truncated")


@pytest.mark.timeout(30)
def test_rank_index_tampering_detected(tmp_path):
    def edit(d):
        name = next(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(".json"))
        text = (d / name).read_text().replace('"step": 2.0', '"step": 7.0', 1)
        (d / name).write_text(text)
    _corrupt_and_check(tmp_path, edit, "rank index is corrupted")


@pytest.mark.timeout(30)
def test_wrong_shapes_refused(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)
    _, other = make(hidden=17)
    with pytest.raises(CheckpointError, match=r"parameter 0: checkpoint was saved for shape \(16, 8\).*\(17, 8\)"):
        offload.load(other, tmp_path)
    single = offload.AdamW(torch.nn.Linear(8, 16).parameters())
    with pytest.raises(CheckpointError, match="2 param group"):
        offload.load(single, tmp_path)


@pytest.mark.timeout(30)
def test_missing_checkpoint_is_clear(tmp_path):
    _, opt = make()
    with pytest.raises(CheckpointError, match="does not exist"):
        offload.load(opt, tmp_path / "nothing")


def rewrite_rank_index(d, mutate):
    """Edit the rank index and re-seal it (fix its crc in index.json): only validation can refuse it."""
    index = json.loads((d / "index.json").read_text())
    name = index["ranks"][0]["index"]
    ridx = json.loads((d / name).read_text())
    mutate(ridx)
    raw = json.dumps(ridx, indent=1).encode()
    (d / name).write_bytes(raw)
    index["ranks"][0]["index_crc32"] = zlib.crc32(raw)
    (d / "index.json").write_text(json.dumps(index, indent=1))


def rewrite_header(d, old, new):
    """Replace text in the safetensors header, keeping its length (padding with spaces)."""
    path = data_file(d)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = f.read(n).decode()
        assert old in head
        head2 = head.replace(old, new)
        head2 = head2.rstrip() + " " * (n - len(head2.rstrip()))
        assert len(head2) == n
        f.seek(8)
        f.write(head2.encode())


# ---------------------------------------------------------------------- 15: user files
USER_FILES = ["ranking.csv", "rank_notes.txt", ".ranked", "rank00000-of-00001.0123456789abcdef.json",
              "rank00000-of-00001.0123456789abcdef.safetensors", "rank00001-of-00002.0123456789abcde.json",
              ".rank00000-of-00001.0123456789abcdef.safetensors.tmp-12-abcdef12", ".index.json.tmp-99-deadbeef",
              ".rank00000-of-00001.0123456789abcdef.intent", "rank00000-of-00001.json.bak", "index.json.orig",
              "rank00000-of-00001.safetensors"]


@pytest.mark.timeout(30)
def test_save_never_deletes_files_it_did_not_create(tmp_path):
    for name in USER_FILES:
        (tmp_path / name).write_text(f"user data {name}")
    model, opt = make()
    for s in range(3):
        train(model, opt, 1, s)
        offload.save(opt, tmp_path)
        offload.save_async(opt, tmp_path).result()
    for name in USER_FILES:
        assert (tmp_path / name).read_text() == f"user data {name}", name
    assert len(os.listdir(tmp_path)) == len(USER_FILES) + 3
    _, opt2 = make()
    offload.load(opt2, tmp_path)
    state_equal(opt, opt2)


@pytest.mark.timeout(30)
def test_save_refuses_to_overwrite_a_foreign_index_json(tmp_path):
    (tmp_path / "index.json").write_text('{"my": "dataset index"}')
    model, opt = make()
    train(model, opt, 1, 0)
    with pytest.raises(CheckpointError, match="not an offload checkpoint index.*refusing to overwrite"):
        offload.save(opt, tmp_path)
    assert os.listdir(tmp_path) == ["index.json"]
    assert (tmp_path / "index.json").read_text() == '{"my": "dataset index"}'


# ---------------------------------------------------------------------- 16: names and symlinks
@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["../outside.json", "/etc/passwd", "sub/x.json", "a\u0000b", "..",
                                 "rank00000-of-00001.0123456789abcdef.json"])
def test_index_names_outside_the_directory_are_refused(tmp_path, bad):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d)
    index = json.loads((d / "index.json").read_text())
    real = index["ranks"][0]["index"]
    (tmp_path / "outside.json").write_bytes((d / real).read_bytes())  # a valid rank index outside
    index["ranks"][0]["index"] = bad
    (d / "index.json").write_text(json.dumps(index))
    before = snapshot(opt2)
    with pytest.raises(CheckpointError, match="refusing to follow"):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["json", "safetensors"])
def test_symlinked_checkpoint_files_are_refused(tmp_path, which):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d)
    name = next(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(which))
    os.rename(d / name, tmp_path / name)
    os.symlink(tmp_path / name, d / name)
    before = snapshot(opt2)
    with pytest.raises(CheckpointError, match="symbolic link"):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)


# ---------------------------------------------------------------------- 17: malformed rank index
def _t(r, key="exp_avg", param=0):
    return next(t for t in r["tensors"] if t["key"] == key and t["param"] == param)


MALFORMED = {
    "param -1": lambda r: _t(r).update(param=-1, name="state.-1.exp_avg"),
    "param 99": lambda r: _t(r).update(param=99, name="state.99.exp_avg"),
    "param bool": lambda r: _t(r).update(param=True),
    "lr tensor abc": lambda r: r["param_groups"][0]["hyper"].update(lr={"__tensor__": "abc"}),
    "lr string": lambda r: r["param_groups"][0]["hyper"].update(lr="abc"),
    "lr list": lambda r: r["param_groups"][1]["hyper"].update(lr=[1, 2]),
    "betas short": lambda r: r["param_groups"][0]["hyper"].update(betas={"__tuple__": [0.9]}),
    "amsgrad int": lambda r: r["param_groups"][0]["hyper"].update(amsgrad=3),
    "params key": lambda r: r["param_groups"][0]["hyper"].update(params=[0]),
    "param_names key": lambda r: r["param_groups"][0]["hyper"].update(param_names=["x"]),
    "group params shifted": lambda r: r["param_groups"][1].update(params=[1, 2]),
    "shape 2**40": lambda r: _t(r).update(shape=[2 ** 40]),
    "shape negative": lambda r: _t(r).update(shape=[-16, -8]),
    "dtype F16": lambda r: _t(r).update(dtype="F16"),
    "dtype unknown": lambda r: _t(r).update(dtype="X99"),
    "offset past end": lambda r: _t(r).update(offsets=[10 ** 9, 10 ** 9 + 512]),
    "offset negative": lambda r: _t(r).update(offsets=[-512, 0]),
    "crc string": lambda r: _t(r).update(crc32="0"),
    "step string": lambda r: r["params"][0].update(step="7"),
    "step negative": lambda r: r["params"][0].update(step=-1),
    "step inf": lambda r: r["params"][0].update(step=float("inf")),
    "has_state string": lambda r: r["params"][0].update(has_state="yes"),
    "no state but tensors": lambda r: r["params"][0].update(has_state=False, step=None),
    "extra step": lambda r: r["params"][0]["extra"].update(step=1),
    "extra nested": lambda r: r["params"][0]["extra"].update(x=json.loads("[" * 60 + "]" * 60)),
    "tensors dict": lambda r: r.update(tensors={}),
    "groups missing": lambda r: r.pop("param_groups"),
    "params not list": lambda r: r.update(params=None),
    "name mismatch": lambda r: _t(r).update(name="state.1.exp_avg"),
    "duplicate tensor": lambda r: r["tensors"].append(dict(_t(r))),
    "multiplier string": lambda r: r.update(pending_grad_multiplier="x"),
    "world_size": lambda r: r.update(world_size=2),
    "data_bytes": lambda r: r.update(data_bytes=r["data_bytes"] + 1),
    "header_bytes": lambda r: r.update(header_bytes=10 ** 12),
    "wrong class": lambda r: r.update(optimizer="SGD", optimizer_kind="SGD"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["ram", "nvme"])
def test_malformed_rank_index_never_changes_the_optimizer(tmp_path, mode):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d, mode)
    pristine = {n: (d / n).read_bytes() for n in os.listdir(d)}
    for case, mutate in MALFORMED.items():
        for n, b in pristine.items():
            (d / n).write_bytes(b)
        rewrite_rank_index(d, mutate)
        before = snapshot(opt2)
        with pytest.raises(CheckpointError):
            offload.load(opt2, d)
        assert_unchanged(before, opt2)
    for n, b in pristine.items():
        (d / n).write_bytes(b)
    offload.load(opt2, d)
    state_equal(opt, opt2)


@pytest.mark.timeout(30)
def test_state_tensor_shape_must_match_its_parameter(tmp_path):
    # transposed state, consistent everywhere (rank index, header, byte count): loads into a
    # (16, 8) parameter only if shapes are checked against the parameters
    d = tmp_path / "ck"
    _, opt2 = _saved(d)
    rewrite_rank_index(d, lambda r: _t(r).update(shape=[8, 16]))
    entry = '"state.0.exp_avg":{"dtype":"F32","shape":'
    rewrite_header(d, entry + "[16,8]", entry + "[8,16]")
    before = snapshot(opt2)
    with pytest.raises(CheckpointError, match=r"state.0.exp_avg.*shape \(8, 16\).*\(16, 8\)"):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)


# ---------------------------------------------------------------------- 18: JSON, FIFO, class, dtypes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["index", "rank"])
def test_single_bit_flips_give_checkpoint_error_or_the_right_state(tmp_path, target):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d)
    pristine = {n: (d / n).read_bytes() for n in os.listdir(d)}
    index = json.loads(pristine["index.json"])
    name = "index.json" if target == "index" else index["ranks"][0]["index"]
    raw = pristine[name]
    rng = random.Random(10 if target == "index" else 11)
    loaded = 0
    for _ in range(100):
        for n, b in pristine.items():
            (d / n).write_bytes(b)
        bit = rng.randrange(len(raw) * 8)
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (d / name).write_bytes(bytes(flipped))
        if target == "rank":  # re-seal: only the validation stands between the flip and the optimizer
            index2 = dict(index, ranks=[dict(index["ranks"][0], index_crc32=zlib.crc32(bytes(flipped)))])
            (d / "index.json").write_text(json.dumps(index2))
        before = snapshot(opt2)
        try:
            offload.load(opt2, d)
        except CheckpointError:
            assert_unchanged(before, opt2)
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"bit {bit}: {type(e).__name__}: {e}")
        loaded += 1
        if target == "index":  # index.json carries no state: a flip that loads loaded the real thing
            state_equal(opt, opt2)
        _, opt2 = make(seed=3)  # a flip that still loads must not have loaded anything else
        train(make(seed=3)[0], opt2, 1, 0)
    assert loaded < 100


@pytest.mark.timeout(30)
def test_fifo_named_index_json_does_not_block(tmp_path):
    d = tmp_path / "ck"
    os.makedirs(d)
    os.mkfifo(d / "index.json")
    _, opt = make()
    out = []

    def run():
        try:
            offload.load(opt, d)
        except BaseException as e:  # noqa: BLE001
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader so that the test run can end
        fd = os.open(d / "index.json", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("offload.load blocked on a FIFO named index.json")
    assert isinstance(out[0], CheckpointError) and "not a regular file" in str(out[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["[" * 100_000, '{"format": "offload-checkpoint", "version": 1}', "\xff\xfe",
                                  '{"format": "offload-checkpoint", "version": 1, "world_size": 1, "generation": '
                                  '"0123456789abcdef", "ranks": [7]}', "1e999999", "9" * 5000, "null", ""])
def test_malformed_index_json_is_a_checkpoint_error(tmp_path, text):
    d = tmp_path / "ck"
    _, opt2 = _saved(d)
    (d / "index.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe" else b"\xff\xfe")
    before = snapshot(opt2)
    with pytest.raises(CheckpointError):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)
