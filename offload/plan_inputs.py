"""plan_inputs.py: what ``offload.plan`` (offload/planner.py) takes beyond its own arithmetic: a model from
a local Hugging Face config.json, the bandwidths of its step-time prediction (offload/bandwidth.py), and
the setup it suggests when the chosen one does not fit this machine.
"""
from __future__ import annotations

import os
import shutil

import torch

from .base.units import human as _fmt, parse_size
from .moments.format import moment_format

__all__ = ["hf_config_model", "bandwidths_of", "suggest_setup"]


# cheapest first: compressed moments in RAM (faster than fp32 moments), then the state on NVMe
_CANDIDATES = (("ram", "bf16"), ("ram", "8bit"), ("nvme", "fp32"), ("nvme", "bf16"), ("nvme", "8bit"))


def suggest_setup(plan, model_or_params, args: dict, chosen: tuple, mp) -> str:
    """The first of _CANDIDATES that fits this machine (``plan``: offload.planner.plan, called again for
    each), as the optimizer arguments to pass; ``mp``: the plan that does not fit."""
    if mp.fits().get("gpu") is False:
        return ("the weights and gradients alone do not fit the GPU: shard them (FSDP, docs/distributed.md) "
                "or use a GPU with more memory; offloading the optimizer state cannot help with them")
    fixed = mp.bytes_of("host", "weights") + mp.bytes_of("host", "gradients")
    if mp.capacity.get("host") is not None and fixed > mp.capacity["host"]:
        return (f"the weights and gradients alone need {_fmt(fixed)} of host memory: no optimizer setup fits; "
                "shard the model across processes (docs/distributed.md) or use a machine with more memory")
    first = str(args["nvme_dir"]).split(",")[0] if args.get("nvme_dir") else os.getcwd()
    try:
        disk = shutil.disk_usage(first).free
    except OSError:
        disk = None
    for state, moments in _CANDIDATES:
        fmt = moment_format(moments)
        if (state, moments) == chosen or (fmt.compressed and mp.config["amsgrad"]):
            continue
        # the fp32 master (or parameter) + the moments (block scales left out): no smaller a file,
        # no layout built for it
        need = mp.config["params"] * (4 + fmt.bytes_per_element)
        if state == "nvme" and disk is not None and need > disk:
            continue
        alt = plan(model_or_params, storage=state, moments=moments, amsgrad=mp.config["amsgrad"], suggest=False, **args)
        if False not in alt.fits().values():
            kw = "" if state == "ram" else f"storage=\"nvme\", nvme_dir=..., host_budget=\"{_fmt(parse_size(args['host_budget']))}\""
            kw = ", ".join(x for x in (kw, f'moments="{moments}"' if fmt.compressed else "") if x)
            return (f"{kw} fits (host {_fmt(alt.total('host'))}" + (f", nvme {_fmt(alt.total('nvme'))}" if state != "ram"
                    else "") + "): docs/moments.md, docs/nvme.md")
    return "no setup of state location and moment format fits this machine"


def bandwidths_of(spec, inv, moments, amsgrad, threads, dirs, bucket_bytes, depth, on_gpu, state_bytes):
    """A Bandwidths from plan()'s ``bandwidths=`` argument (offload/bandwidth.py)."""
    from . import bandwidth
    if isinstance(spec, bandwidth.Bandwidths):
        return spec
    if isinstance(spec, dict):
        return bandwidth.Bandwidths(**spec)
    weight = {}
    for n, dt, _ in inv:
        weight[dt] = weight.get(dt, 0) + n
    dtype = max(weight, key=weight.get) if weight else torch.float32
    if isinstance(spec, str) and spec == "measure":
        return bandwidth.measure(param_dtype=dtype, moments=moments, amsgrad=amsgrad, threads=threads, dirs=dirs,
                                 request=bucket_bytes, inflight=depth, cuda=on_gpu, state_bytes=state_bytes,
                                 params=sum(n for n, _, active in inv if active))
    return bandwidth.from_json(spec, moments=moments, param_dtype=dtype, threads=threads)


def hf_config_model(path) -> torch.nn.Module:
    """The model a local Hugging Face ``config.json`` (or the folder holding one) describes, built on the
    meta device: real parameter shapes, no memory, nothing downloaded."""
    path = os.fspath(path)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json there (give a local Hugging Face config.json or its folder)")
    try:
        import transformers
    except ImportError:
        raise ImportError("planning from a config.json needs transformers (pip install transformers)") from None
    cfg = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:   # not a causal LM (an encoder, a classifier): the base model
            return transformers.AutoModel.from_config(cfg)
