"""test_checkpoint_resume.py: offload.save / offload.load resume exactly: bitwise-identical training after
a load (offload.AdamW and torch.optim.AdamW, RAM, NVMe, mmap state and the GPU engine), the files are
safetensors plus JSON indexes, a resave replaces the previous generation, loads replace state keys and
hyperparameters and never unpickle, the optimizer class is checked, complex and float64 state."""
import json
import os

import pytest
import torch

import offload
from offload import CheckpointError
from checkpoint_util import _mode_kwargs, assert_unchanged, data_file, make, snapshot, state_equal, train


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", [offload.AdamW, torch.optim.AdamW])
def test_resume_is_bitwise_identical(tmp_path, cls):
    ref_model, ref_opt = make(cls=cls)
    train(ref_model, ref_opt, 6, 0)

    model, opt = make(cls=cls)
    train(model, opt, 3, 0)
    offload.save(opt, tmp_path / "ckpt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2 = make(seed=123, cls=cls)  # different init: everything must come from the files
    model2.load_state_dict(weights)
    offload.load(opt2, tmp_path / "ckpt")
    state_equal(opt, opt2)
    assert opt2.param_groups[1]["lr"] == 3e-3
    train(model2, opt2, 3, 3)
    for (n, a), b in zip(ref_model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n
    state_equal(ref_opt, opt2)


@pytest.mark.timeout(30)
def test_file_is_safetensors_and_index_is_json(tmp_path):
    from safetensors import safe_open
    model, opt = make()
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    params = [p for g in opt.param_groups for p in g["params"]]
    with safe_open(data_file(tmp_path), "pt") as f:
        names = set(f.keys())
        for name in names:
            _, i, key = name.split(".", 2)
            assert torch.equal(f.get_tensor(name), opt.state[params[int(i)]][key])
    assert {"state.2.master_param", "state.0.max_exp_avg_sq"} <= names
    index = json.loads((tmp_path / "index.json").read_text())
    rank = json.loads((tmp_path / index["ranks"][0]["index"]).read_text())
    assert [p["step"] for p in rank["params"]] == [2.0] * 4
    assert all(isinstance(t["crc32"], int) for t in rank["tensors"])


@pytest.mark.timeout(30)
def test_resave_replaces_previous_generation(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)
    first = set(os.listdir(tmp_path))
    train(model, opt, 1, 1)
    offload.save(opt, tmp_path)
    second = set(os.listdir(tmp_path))
    assert len(second) == 3 and first & second == {"index.json"}


@pytest.mark.timeout(30)
def test_progress_bar(tmp_path, capsys):
    pytest.importorskip("tqdm")
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path, progress=True, chunk_bytes=4096)
    assert "offload.save rank 0" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_load_replaces_state_keys_and_hyperparameters(tmp_path):
    model, opt = make(amsgrad=False)
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    model2, opt2 = make(amsgrad=True)
    train(model2, opt2, 1, 0)  # has max_exp_avg_sq and step 1
    model2.load_state_dict(model.state_dict())
    offload.load(opt2, tmp_path)
    assert opt2.param_groups[0]["amsgrad"] is False
    state_equal(opt, opt2)
    train(model, opt, 2, 2)
    train(model2, opt2, 2, 2)
    state_equal(opt, opt2)


@pytest.mark.timeout(30)
def test_load_never_unpickles(tmp_path, monkeypatch):
    import pickle

    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)

    def refuse(*a, **k):
        raise AssertionError("offload.load must not unpickle")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _, opt2 = make()
    offload.load(opt2, tmp_path)
    state_equal(opt, opt2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["nvme", "mmap", "gpu-fake"])
def test_resume_with_nvme_state_or_gpu_engine(tmp_path, mode):
    def build(seed=0):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model[2].to(torch.bfloat16)
        opt = offload.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
                            lr=1e-2, **_mode_kwargs(mode, tmp_path / f"s{seed}"))
        return model, opt

    def run(model, opt, steps, start):
        for s in range(start, start + steps):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1000 + s))
            model[2](model[1](model[0](x)).to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    ref_model, ref_opt = build(seed=0)
    run(ref_model, ref_opt, 6, 0)
    model, opt = build(seed=0)
    run(model, opt, 3, 0)
    offload.save(opt, tmp_path / "ck")
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2 = build(seed=7)
    model2.load_state_dict(weights)
    offload.load(opt2, tmp_path / "ck")
    state_equal(opt, opt2)
    run(model2, opt2, 3, 3)
    for o in (ref_opt, opt2):
        if hasattr(o, "synchronize"):
            o.synchronize()  # GPU mode: new weights go up asynchronously
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    state_equal(ref_opt, opt2)
    if mode == "gpu-fake":
        with pytest.raises(NotImplementedError, match="save_async with GPU offload"):
            offload.save_async(opt2, tmp_path / "ck2")
    for o in (ref_opt, opt, opt2):
        o.close()


@pytest.mark.timeout(30)
def test_optimizer_class_is_checked(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)
    for other in (torch.optim.SGD(model.parameters(), lr=0.1), offload.Adam(model.parameters()),
                  torch.optim.Adam(model.parameters())):
        groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
        other = type(other)(groups, lr=0.1)
        before = snapshot(other)
        with pytest.raises(CheckpointError, match="saved from a AdamW optimizer.*different things"):
            offload.load(other, tmp_path)
        assert_unchanged(before, other)
    # the same family across implementations is allowed: torch.optim.AdamW <-> offload.AdamW
    lin = torch.nn.Linear(4, 3)
    t_opt = torch.optim.AdamW(lin.parameters(), lr=0.01)
    lin(torch.randn(2, 4)).sum().backward()
    t_opt.step()
    offload.save(t_opt, tmp_path / "t")
    o_opt = offload.AdamW(lin.parameters(), lr=0.5)
    offload.load(o_opt, tmp_path / "t")
    assert o_opt.param_groups[0]["lr"] == 0.01
    state_equal(t_opt, o_opt)


@pytest.mark.timeout(30)
def test_complex_and_float64_state_round_trip(tmp_path):
    from safetensors import safe_open

    def build():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=dt)) for dt in
              (torch.complex64, torch.complex128, torch.float64)]
        return ps, torch.optim.AdamW(ps, lr=0.01, amsgrad=True)

    def run(ps, opt, steps):
        for s in range(steps):
            g = torch.Generator().manual_seed(s)
            for p in ps:
                p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
            opt.step()

    ps, opt = build()
    run(ps, opt, 2)
    offload.save(opt, tmp_path)
    with safe_open(data_file(tmp_path), "pt") as f:
        c128 = f.get_tensor("state.1.exp_avg")  # no safetensors tag for complex128: its real view
        assert c128.dtype == torch.float64 and torch.equal(torch.view_as_complex(c128), opt.state[ps[1]]["exp_avg"])
        assert torch.equal(f.get_tensor("state.0.exp_avg"), opt.state[ps[0]]["exp_avg"])  # C64
        assert torch.equal(f.get_tensor("state.2.max_exp_avg_sq"), opt.state[ps[2]]["max_exp_avg_sq"])
    ps2, opt2 = build()
    with torch.no_grad():
        for a, b in zip(ps2, ps):
            a.copy_(b)
    offload.load(opt2, tmp_path)
    state_equal(opt, opt2)
    run(ps, opt, 1)
    run(ps2, opt2, 1)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
