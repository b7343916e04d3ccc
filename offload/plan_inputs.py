"""plan_inputs.py: what ``offload.plan`` (offload/planner.py) takes beyond its own arithmetic: a
model from a local Hugging Face config.json, the bandwidths of its step-time prediction
(offload/bandwidth.py), and the setup it suggests when the chosen one does not fit this machine.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from .base.units import human as _fmt, parse_size
from .moments.format import moment_format
from .plan_args import MAX_COUNT, dirs as _dirs

__all__ = ["hf_config_model", "config_file", "read_config", "bandwidths_of", "suggest_setup"]


# cheapest first: compressed moments in RAM (faster than fp32 moments), then the state on NVMe
_CANDIDATES = (("ram", "bf16"), ("ram", "8bit"), ("nvme", "fp32"), ("nvme", "bf16"),
               ("nvme", "8bit"))


def suggest_setup(plan, model_or_params, args: dict, chosen: tuple, mp) -> str:
    """The first of _CANDIDATES that fits this machine (``plan``: offload.planner.plan, called
    again for each), as the optimizer arguments to pass; ``mp``: the plan that does not fit."""
    if mp.fits().get("gpu") is False:
        return ("the weights and gradients alone do not fit the GPU: shard them (FSDP, "
                "docs/distributed.md) or use a GPU with more memory; offloading the optimizer "
                "state cannot help with them")
    fixed = mp.bytes_of("host", "weights") + mp.bytes_of("host", "gradients")
    if mp.capacity.get("host") is not None and fixed > mp.capacity["host"]:
        return (f"the weights and gradients alone need {_fmt(fixed)} of host memory: no optimizer "
                "setup fits; shard the model across processes (docs/distributed.md) or use a "
                "machine with more memory")
    first = _dirs(args.get("nvme_dir"))[0] or os.getcwd()
    try:
        disk = shutil.disk_usage(first).free
    except OSError:
        disk = None
    for state, moments in _CANDIDATES:
        fmt = moment_format(moments)
        if (state, moments) == chosen or (fmt.compressed and mp.config["amsgrad"]):
            continue
        # this rank's moments alone, a lower bound of the state: a setup they do not fit is skipped
        least = mp.config["state_params"] * fmt.bytes_per_element   # m, v; block scales left out
        host = mp.capacity.get("host")
        if (state == "nvme" and disk is not None and least > disk) or (
                state == "ram" and host is not None and fixed + least > host):
            continue
        where = dict(args, nvme_dir=args["nvme_dir"] if state != "ram" else None)
        try:
            alt = plan(model_or_params, storage=state, moments=moments,
                       amsgrad=mp.config["amsgrad"], suggest=False, **where)
        except ValueError:   # a setup it cannot take (a host_budget too small for its buckets)
            continue
        if False not in alt.fits().values():
            budget = _fmt(parse_size(args["host_budget"]))
            kw = "" if state == "ram" else f'storage="nvme", nvme_dir=..., host_budget="{budget}"'
            mom = f'moments="{moments}"' if fmt.compressed else ""
            kw = ", ".join(x for x in (kw, mom) if x)
            nvme = f", nvme {_fmt(alt.total('nvme'))}" if state != "ram" else ""
            return (f"{kw} fits (host {_fmt(alt.total('host'))}{nvme}): "
                    "docs/moments.md, docs/nvme.md")
    return "no setup of state location and moment format fits this machine"


def bandwidths_of(spec, inv, moments, amsgrad, threads, dirs, bucket_bytes, depth, on_gpu,
                  state_bytes):
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
        return bandwidth.measure(param_dtype=dtype, moments=moments, amsgrad=amsgrad,
                                 threads=threads, dirs=dirs,
                                 request=bucket_bytes, inflight=depth, cuda=on_gpu,
                                 state_bytes=state_bytes,
                                 params=sum(n for n, _, active in inv if active))
    return bandwidth.from_json(spec, moments=moments, param_dtype=dtype, threads=threads)


def hf_config_model(path) -> torch.nn.Module:
    """The model a local Hugging Face ``config.json`` (or the folder holding one; a file of another
    name is read itself) describes, built on the meta device: real parameter shapes, no memory,
    nothing downloaded. What can be checked without transformers is checked first
    (:func:`read_config`); transformers' own errors, which vary by version and model, come back as
    one line naming the file."""
    file = config_file(path)
    read_config(file)
    try:
        import transformers
    except ImportError:
        raise ImportError("planning from a config.json needs transformers (pip "
                          "install transformers)") from None
    try:
        cfg = transformers.AutoConfig.from_pretrained(file, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{file}: not a config transformers can read: {_one_line(e)}") from None
    with torch.device("meta"):
        try:
            try:
                return transformers.AutoModelForCausalLM.from_config(cfg)
            except ValueError:   # not a causal LM (an encoder, a classifier): the base model
                return transformers.AutoModel.from_config(cfg)
        except Exception as e:
            raise ValueError(f"{file}: transformers could not build this "
                             f"model: {_one_line(e)}") from None


def config_file(path) -> str:
    """The config.json ``path`` names: the file itself, or ``config.json`` in a folder."""
    path = os.fsdecode(os.fspath(path))
    if not path:
        raise ValueError("an empty path: give a local Hugging Face config.json or its folder")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no config.json there (give a local Hugging Face "
                                "config.json or its folder)")
    return file


# keys of a config.json that size the parameters (GPT-2, Llama, T5, BART, MoE spellings)
_SIZE_KEYS = frozenset((
    "hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
    "d_model", "d_ff", "d_kv", "num_layers", "encoder_layers", "decoder_layers", "ffn_dim",
    "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size", "num_experts",
    "num_local_experts", "n_routed_experts"))
_LAYER_KEYS = frozenset(("num_hidden_layers", "n_layer", "num_layers", "encoder_layers",
                         "decoder_layers"))
MAX_LAYERS = 1000   # the largest models have a few hundred; building more takes long, even on meta


def read_config(file: str) -> dict:
    """The JSON object in ``file``, its sizes and counts checked: whole numbers >= 0 (None, a list
    or an object are left to transformers), at most ``MAX_LAYERS`` layers."""
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:   # json.JSONDecodeError is a ValueError
        raise ValueError(f"{file}: not JSON ({_one_line(e)})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a JSON object (a Hugging Face config.json holds one)")
    if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
        raise ValueError(f"{file}: has no model_type (a Hugging Face config.json names its "
                         "architecture in it)")
    todo = [cfg]
    while todo:   # nested configs too (text_config, vision_config, ...)
        for key, v in todo.pop().items():
            if isinstance(v, dict):
                todo.append(v)
            elif key in _SIZE_KEYS and v is not None and not isinstance(v, list):
                whole = isinstance(v, int) and not isinstance(v, bool)
                if not whole or not 0 <= v <= MAX_COUNT:
                    shown = f"{v:,}" if whole else repr(v)
                    raise ValueError(f"{file}: {key} = {shown}: a size must be a whole number "
                                     f"from 0 to {MAX_COUNT:,}")
                if key in _LAYER_KEYS and v > MAX_LAYERS:
                    raise ValueError(f"{file}: {key} = {v:,}: the planner builds models of at "
                                     f"most {MAX_LAYERS:,} layers")
    return cfg


def _one_line(e: BaseException) -> str:
    """An exception's message on one line (transformers' span several)."""
    text = " ".join(x.strip() for x in str(e).splitlines() if x.strip()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
