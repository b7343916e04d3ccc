"""bench/gpu_peers.py: the peers' rows of ``python -m offload.bench gpu``, each configured as its
own documentation says (DeepSpeed 0.19.8 ZeRO-2 with ``offload_optimizer: cpu``, Twin-Flow and
ZenFlow, torchao's CPUOffloadOptimizer, FSDP2 with CPUOffloadPolicy under torch's fused AdamW or
offload.AdamW).

Each builder takes the fp32 model on the device and returns a Trainer (offload/bench/gpu_rows.py).
Rows that need a process group (DeepSpeed, FSDP2) make one of world size 1 (NCCL on a GPU, gloo on
the CPU) first.
"""
from __future__ import annotations

import os
import socket

import torch

from .gpt import param_groups
from .gpu_rows import Row, Trainer

ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_group(setup) -> None:
    """A process group of one, made before ``import deepspeed`` (which otherwise looks for MPI)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    if setup.cuda:
        torch.cuda.set_device(setup.device)
    dist.init_process_group("nccl" if setup.cuda else "gloo")


# -----------------------------------------------------------------------------------------
# DeepSpeed
def _ds_config(setup, zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": setup.batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": dict(ADAMW, lr=setup.lr)},
            "zero_optimization": zero, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


ZERO2 = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
         "allgather_bucket_size": 5e8, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
TWIN_FLOW = {"stage": 3, "offload_param": {"device": "none"}, "sub_group_size": 5e7,
             "stage3_param_persistence_threshold": 1e9, "overlap_comm": True,
             "contiguous_gradients": True,
             "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5}}
ZEN_FLOW = dict(ZERO2, zenflow={"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True})


class _DeepSpeedStep:
    """DeepSpeed's engine behind the Trainer's model/optimizer calls: the engine is the model,
    ``engine.backward`` the backward, ``engine.step`` the update."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, x, y):
        return self.engine(x, y)


def deepspeed_row(zero: dict):
    def build(setup, model):
        _process_group(setup)
        import deepspeed
        engine, opt, _, _ = deepspeed.initialize(model=model,
                                                 model_parameters=param_groups(model, 0.1),
                                                 config=_ds_config(setup, zero))

        class DSTrainer(Trainer):
            def iteration(self, x, y):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                return loss.detach()

        def close():
            destroy = getattr(engine, "destroy", None)
            if destroy is not None:
                destroy()
        threads = {"deepspeed_omp": int(os.environ.get("OMP_NUM_THREADS", "0") or 0)}
        return DSTrainer(engine, None, close=close, threads=threads)
    return build


# --------------------------------------------------------------------------------------------
# torchao
def _torchao(setup, model):
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from torchao.optim import CPUOffloadOptimizer
    model = model.to(torch.bfloat16)
    opt = CPUOffloadOptimizer(param_groups(model, 0.1), torch.optim.AdamW, offload_gradients=False,
                              fused=True, lr=setup.lr)
    return Trainer(model, opt)


# ----------------------------------------------------------------------------------------------
# FSDP2
def _fully_shard_all(model, **kw):
    from torch.distributed.fsdp import fully_shard
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def _fsdp2_torch(setup, model):
    """torch's own offload: fp32 shards on the host are the master, bf16 compute through the mixed
    precision policy, torch's fused AdamW on the CPU DTensors after backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    _process_group(setup)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _fully_shard_all(model, offload_policy=CPUOffloadPolicy(pin_memory=setup.cuda),
                             mp_policy=mp)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=setup.lr, fused=True)
    return Trainer(model, opt)


def _fsdp2_offload(setup, model):
    """The same FSDP2 CPUOffloadPolicy model in bf16, with offload.AdamW on its host shards
    (offload keeps the fp32 master and steps in its host mode)."""
    import offload
    from torch.distributed.fsdp import CPUOffloadPolicy
    _process_group(setup)
    model = _fully_shard_all(model.to(torch.bfloat16),
                             offload_policy=CPUOffloadPolicy(pin_memory=setup.cuda))
    groups = param_groups(model, 0.1)
    where = {p.device.type for g in groups for p in g["params"]}
    if where != {"cpu"}:
        raise RuntimeError(f"FSDP2 CPUOffloadPolicy left parameters on {sorted(where)}: offload "
                           "would step them in its device mode")
    opt = offload.AdamW(groups, lr=setup.lr)
    threads = {"offload": opt.kernel_threads or offload.kernels.get_num_threads()}
    return Trainer(model, opt, close=opt.close, threads=threads)


def rows() -> list:
    """The peers' rows."""
    ds = ("deepspeed",)
    return [
        Row("deepspeed_zero2", "DeepSpeed ZeRO-2, offload_optimizer cpu", deepspeed_row(ZERO2),
            needs=ds, note="fp32 gradients to the host; the whole CPU Adam inside step()"),
        Row("torchao", "torchao CPUOffloadOptimizer", _torchao, needs=("torchao",), cuda_only=True,
            note="bf16 state, no fp32 master; no clipping"),
        Row("fsdp2_torch", "FSDP2 CPUOffloadPolicy + torch AdamW(fused)", _fsdp2_torch),
        Row("fsdp2_offload", "FSDP2 CPUOffloadPolicy + offload.AdamW", _fsdp2_offload,
            offload=True),
        Row("deepspeed_twinflow", "DeepSpeed Twin-Flow (ZeRO-3, ratio 0.5)",
            deepspeed_row(TWIN_FLOW), needs=ds, note="ratio set by hand"),
        Row("deepspeed_zenflow", "DeepSpeed ZenFlow (timed only)", deepspeed_row(ZEN_FLOW),
            needs=ds,
            note="timings only: not Adam every step, and DeepSpeed 0.19.8 transposes 2-D weights "
                 "at initialize, so its losses are not comparable"),
    ]
