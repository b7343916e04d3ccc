"""offload inside transformers' Trainer: checkpoint and resume (tiny random Llama, CPU, no downloads).

The Trainer saves ``model.state_dict()`` and then ``optimizer.state_dict()`` right after a step; with
device parameters (GPU-offload mode) the model's weights may still be uploading then, and the
checkpoint held the weights before the step beside the optimizer state after it: a resumed run
diverged (losses from the first resumed step on). Module ``state_dict()`` now waits for the uploads
of the module's parameters. Every mode resumes bitwise here.
"""
import warnings

import pytest
import torch

import offload
from conftest import Config, configs
from offload.device import FakeDevice
from tiny_models import Counting, tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


# the setups each trained by the Trainer (conftest.py configs()); the fake device's copies take 20 ms and
# poison their destination until they land: the upload is still running when the Trainer saves the model
SETUPS = dict(sides=("host", "fake"), tiers=("ram", "nvme"), moments=("fp32", "8bit"), schedules=("deferred",),
              cover="listed", include=[("host", "ram", "fp32"), ("host", "nvme", "fp32"), ("host", "ram", "8bit"),
                                       ("fake", "ram", "fp32", "deferred")])


def train(tmp_path, cfg, steps, save=None, resume=None, max_grad_norm=1.0):
    from transformers import Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    model = tiny_llama()
    slow = dict(offload_device=FakeDevice(min_delay=0.02, max_delay=0.02)) if cfg.side == "fake" else {}
    opt = offload.AdamW(model.parameters(), **cfg.kwargs(tmp_path, lr=3e-3, **slow))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=16,
                             logging_steps=1, max_grad_norm=max_grad_norm, use_cpu=True, report_to=[],
                             save_strategy="steps" if save else "no", save_steps=save or 10 ** 6,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0, lr_scheduler_type="constant")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=Counting(256, 24),
                          optimizers=(opt, None))
        trainer.train(resume_from_checkpoint=resume)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = [p.detach().clone() for p in model.parameters()]
    if hasattr(opt, "close"):
        opt.close()
    return losses, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cfg", configs(**SETUPS))
def test_trainer_checkpoint_resume_is_bitwise(tmp_path, cfg):
    losses, params = train(tmp_path, cfg, 6, save=3)
    r_losses, r_params = train(tmp_path, cfg, 6, resume=str(tmp_path / "out" / "checkpoint-3"))
    assert r_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(r_params, params))


@pytest.mark.timeout(120)
def test_trainer_clipping_with_buckets_stepped_during_backward_is_refused(tmp_path):
    """The Trainer clips (max_grad_norm, default 1.0) between backward and step: with buckets stepped
    during backward (the GPU-offload default) that is refused by name, saying what to pass instead."""
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        train(tmp_path, Config("cpu"), 3)   # the device default: eager


def _trainer_run(tmp_path, **trainer_kw):
    from transformers import Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=16,
                             logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", learning_rate=1.0,
                             weight_decay=0.1, dataloader_num_workers=0, disable_tqdm=True, seed=0,
                             lr_scheduler_type="constant")
    if "optimizers" in trainer_kw:   # the Trainer's own grouping: weight decay off for biases and norms
        decay = set(Trainer(model=model, args=args).get_decay_parameter_names(model))
        groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
                  {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
        trainer_kw = dict(optimizers=(offload.AdamW(groups, lr=3e-3), None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=Counting(64, 24), **trainer_kw)
        trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)   # accelerate wraps it
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lrs = [g["lr"] for g in opt.param_groups]
    opt.close()
    return type(opt), lrs, losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_trainer_builds_offload_from_optimizer_cls_and_kwargs(tmp_path):
    """Trainer(optimizer_cls_and_kwargs=(offload.AdamW, kwargs)): the Trainer builds the optimizer itself
    (after moving the model), on its weight-decay groups; lr comes from kwargs, not TrainingArguments. The
    run equals one with optimizers=(offload.AdamW(same groups), None) bitwise. TrainingArguments(optim=)
    takes only transformers' own optimizer names."""
    from transformers import TrainingArguments
    cls, lrs, losses, params = _trainer_run(tmp_path, optimizer_cls_and_kwargs=(offload.AdamW, {"lr": 3e-3}))
    assert cls is offload.AdamW and lrs == [3e-3, 3e-3]
    _, _, ref_losses, ref_params = _trainer_run(tmp_path, optimizers=True)
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(params, ref_params))
    with pytest.raises(ValueError):
        TrainingArguments(output_dir=str(tmp_path / "x"), optim="offload_adamw", use_cpu=True)
