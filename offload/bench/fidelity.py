"""bench/fidelity.py: ``python -m offload.bench fidelity``: does training with compressed Adam
moments match fp32?

A small causal transformer LM (``offload/bench/gpt.py``) learns a synthetic token stream with a
known entropy floor: an order-2 Markov process (the last token picks 8 possible successors, the
last two their probabilities through a fixed random table of contexts), so the loss keeps falling
for hundreds of steps. Every contender starts from the
same initial weights and sees the same batches and learning-rate schedule (linear warm-up, cosine
decay to 10%); they run round-robin, one training step each in turn, in one process.

Contenders (offload/bench/fidelity_optim.py): torch.optim.AdamW (reference), offload with fp32,
bf16 and 8-bit moments, torchao's and bitsandbytes' AdamW8bit when they import and run on this CPU.
Reported: the mean loss of the last 50 steps and its ratio to fp32 moments (targets: bf16
<= +0.5%, 8bit <= +1%), the median ``opt.step()`` and iteration times, and the relative L2 error of
the moments (a) against the fp32-moment run after N steps and (b) against exact fp32 moments
accumulated from the contender's own gradients (the encoding error alone, no trajectory drift).

Sizes: default (benchmark, 400 steps, a few minutes on 2 cores), ``--quick`` (test-sized, 300
steps), ``--preset NAME`` (the GPT of ``bench train``, e.g. ``small``, on the same kind of stream).
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, replace

import torch

import offload

from .common import Progress, cpu_model, format_table, machine_info, median, write_json
from .fidelity_optim import BASELINE, CONTENDERS, Skip, compressed_fraction, implementation, \
    make_optimizer, read_moments, set_lr
from ..moments.format import FORMATS
from .gpt import GPT, PRESETS, GPTConfig, param_groups

__all__ = ["Size", "SIZES", "MarkovStream", "run", "add_parser", "TARGETS"]

TARGETS = {"bf16": 1.005, "8bit": 1.01}  # last-50-step loss / fp32-moment loss
LAST = 50


@dataclass
class Size:
    vocab: int
    contexts: int  # distinct next-token distributions of the stream
    seq: int
    batch: int
    d_model: int
    n_layer: int
    n_head: int
    steps: int
    warmup: int
    lr: float


SIZES = {
    "default": Size(vocab=128, contexts=8192, seq=64, batch=16, d_model=128, n_layer=2, n_head=4,
                    steps=400, warmup=40, lr=3e-3),
    "quick": Size(vocab=64, contexts=2048, seq=32, batch=8, d_model=64, n_layer=2, n_head=4,
                  steps=300, warmup=30, lr=3e-3),
}


class MarkovStream:
    """Order-2 token process with structure at every order, so the loss falls steadily: the last
    token b fixes a set of K successor tokens (a bigram table), and the context (R[a] + b) mod C
    of the last two fixes their probabilities (Dirichlet(1/2), one draw per context). Sequences
    start with two uniform tokens. ``sample`` also returns the Bayes-optimal loss of every target
    (what a perfect model pays): its mean is the entropy floor of the data actually drawn."""

    def __init__(self, vocab: int, contexts: int, successors: int = 8, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.contexts = vocab, contexts
        self.R = torch.randint(0, contexts, (vocab,), generator=g)
        k = min(successors, vocab)
        # k distinct per token
        self.succ = torch.argsort(torch.rand(vocab, vocab, generator=g), dim=1)[:, :k]
        # Gamma(1/2) -> Dirichlet(1/2)
        e = torch.randn(contexts, k, generator=g, dtype=torch.float64).square()
        self.probs = (e + 1e-12) / (e + 1e-12).sum(1, keepdim=True)
        self.cum = self.probs.cumsum(1)

    def sample(self, batch: int, length: int, g: torch.Generator):
        x = torch.empty(batch, length, dtype=torch.long)
        nll = torch.empty(batch, length, dtype=torch.float64)
        x[:, :2] = torch.randint(0, self.vocab, (batch, 2), generator=g)
        nll[:, :2] = math.log(self.vocab)
        for t in range(2, length):
            b = x[:, t - 1]
            c = (self.R[x[:, t - 2]] + b) % self.contexts
            u = torch.rand(batch, 1, generator=g, dtype=torch.float64)
            j = torch.searchsorted(self.cum[c], u).clamp_(max=self.succ.shape[1] - 1).squeeze(1)
            x[:, t] = self.succ[b, j]
            nll[:, t] = -torch.log(self.probs[c, j])
        return x, nll


def lr_at(step: int, s: Size) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def rel_l2(a: list, b: list, which: int) -> float:
    num = sum(float((x[which] - y[which]).double().pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y[which].double().pow(2).sum()) for y in b)
    return math.sqrt(num / den) if den > 0 else float("nan")


class Run:
    """One contender: its model copy, optimizer, exact shadow moments and the figures collected."""

    def __init__(self, name, model, opt, beta1, beta2):
        self.name, self.model, self.opt = name, model, opt
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.b1, self.b2 = beta1, beta2
        self.shadow = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.losses, self.step_s, self.iter_s, self.moments, self.shadow_at = [], [], [], {}, {}

    def train_step(self, idx, tgt, lr: float) -> None:
        set_lr(self.opt, lr)
        t0 = time.perf_counter()
        loss = self.model(idx, tgt)
        loss.backward()
        t1 = time.perf_counter()
        with torch.no_grad():  # exact fp32 moments of this run's own gradients (untimed)
            for p, (m, v) in zip(self.params, self.shadow):
                m.lerp_(p.grad, 1 - self.b1)
                v.mul_(self.b2).addcmul_(p.grad, p.grad, value=1 - self.b2)
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        self.step_s.append(t3 - t2)
        self.iter_s.append(t1 - t0 + t3 - t2)

    def snapshot(self, step: int) -> None:
        self.moments[step] = read_moments(self.opt, self.params)
        self.shadow_at[step] = [(m.clone(), v.clone()) for m, v in self.shadow]


def build_size(args) -> Size:
    s = SIZES["quick" if args.quick else "default"]
    if args.preset:
        c = PRESETS[args.preset]
        s = replace(s, vocab=c.vocab, contexts=max(s.contexts, c.vocab * 4), seq=c.seq,
                    d_model=c.d_model, n_layer=c.n_layer, n_head=c.n_head, batch=8)
    for k in ("steps", "batch", "lr", "warmup", "seq"):
        if getattr(args, k, None) is not None:
            s = replace(s, **{k: getattr(args, k)})
    if s.steps <= LAST:
        raise SystemExit(f"--steps must exceed {LAST} (the loss is averaged over the "
                         f"last {LAST} steps)")
    return s


def run(size: Size, contenders, *, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, seed=0,
        moment_step=50, progress=True) -> dict:
    """Train every contender on the same stream; return the figures (see module docstring)."""
    stream = MarkovStream(size.vocab, size.contexts, seed=seed + 1234)
    gen = torch.Generator().manual_seed(seed + 1)
    batches, nlls = [], []
    for _ in range(size.steps):
        x, nll = stream.sample(size.batch, size.seq + 1, gen)
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
        nlls.append(nll[:, 1:])
    floor = float(torch.stack(nlls).mean())
    cfg = GPTConfig(vocab=size.vocab, seq=size.seq, n_layer=size.n_layer, n_head=size.n_head,
                    d_model=size.d_model)
    torch.manual_seed(seed)
    init = GPT(cfg).state_dict()
    hyper = dict(lr=size.lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    runs, skipped = [], {}
    for name in contenders:
        model = GPT(cfg)
        model.load_state_dict(init)
        try:
            opt = make_optimizer(name, param_groups(model, weight_decay), hyper)
        except Skip as e:
            skipped[name] = str(e)
            continue
        runs.append(Run(name, model, opt, beta1, beta2))
    checkpoints = sorted({min(moment_step, size.steps), size.steps})
    bar = Progress(size.steps, "fidelity", enabled=progress)
    for step in range(size.steps):
        idx, tgt = batches[step]
        lr = lr_at(step, size)
        k = step % max(1, len(runs))
        for r in runs[k:] + runs[:k]:  # rotate the order: no contender always runs first
            try:
                r.train_step(idx, tgt, lr)
            except Exception as e:  # a peer that constructs but cannot step on this CPU
                if step > 0 or r.name == "torch" or r.name in FORMATS:   # torch, offload
                    raise
                skipped[r.name] = (f"step failed on this machine ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:100]})")
                runs.remove(r)
                continue
            if step + 1 in checkpoints:
                r.snapshot(step + 1)
        bar.update(f"step {step + 1}")
    bar.close()
    return summarize(runs, skipped, size, floor, checkpoints, hyper)


def summarize(runs, skipped, size, floor, checkpoints, hyper) -> dict:
    ref = next((r for r in runs if r.name == BASELINE), None)
    rows = []
    for r in runs:
        last = sum(r.losses[-LAST:]) / LAST
        row = dict(name=r.name, impl=implementation(r.name, r.opt), moments=CONTENDERS[r.name][1],
                   last50=last,
                   step_ms=median(r.step_s[5:] or r.step_s) * 1e3,
                   iter_ms=median(r.iter_s[5:] or r.iter_s) * 1e3,
                   compressed=compressed_fraction(r.opt, r.params), losses=r.losses, error={})
        for n in checkpoints:
            e = row["error"][n] = {}
            if ref is not None:
                e["m_vs_fp32_run"] = rel_l2(r.moments[n], ref.moments[n], 0)
                e["v_vs_fp32_run"] = rel_l2(r.moments[n], ref.moments[n], 1)
            e["m_vs_own_exact"] = rel_l2(r.moments[n], r.shadow_at[n], 0)
            e["v_vs_own_exact"] = rel_l2(r.moments[n], r.shadow_at[n], 1)
        rows.append(row)
    base = next((row for row in rows if row["name"] == BASELINE), None)
    targets = []
    for row in rows:
        if base is not None:
            row["ratio"] = row["last50"] / base["last50"]
            row["excess_ratio"] = (row["last50"] - floor) / (base["last50"] - floor)
        if base is not None and row["name"] in TARGETS:
            lim = TARGETS[row["name"]]
            ok = row["ratio"] <= lim
            row["target"] = lim
            targets.append(f"{'PASS' if ok else 'MISS'} {row['name']} moments: last-{LAST} loss "
                           f"{row['last50']:.5f} = {row['ratio']:.5f} x fp32 "
                           f"({base['last50']:.5f}; target <= {lim:.3f})")
    return dict(size=asdict(size), floor=floor, hyper={**hyper, "betas": list(hyper["betas"])},
                rows=rows, skipped=skipped, checkpoints=checkpoints, targets=targets,
                params=sum(p.numel() for p in runs[0].params) if runs else 0)


def _f(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def tables(out: dict) -> str:
    rows = out["rows"]
    lines = [format_table(
        ["contender", "moments", f"loss last {LAST}", "vs fp32", "excess vs fp32", "opt.step ms",
         "iter ms"],
        [[r["name"] + ": " + r["impl"], r["moments"], f"{r['last50']:.5f}",
          _f(r.get("ratio"), ".5f"),
          _f(r.get("excess_ratio"), ".3f"), f"{r['step_ms']:.2f}", f"{r['iter_ms']:.1f}"]
         for r in rows])]
    n0, n1 = out["checkpoints"][0], out["checkpoints"][-1]
    hdr = ["contender", "compressed"]
    if len(out["checkpoints"]) > 1:
        hdr += [f"m vs fp32 run @{n0}", f"v @{n0}"]
    hdr += [f"m vs fp32 run @{n1}", f"v @{n1}", f"m vs exact own @{n1}", f"v @{n1} "]
    body = []
    for r in rows:
        e0, e1 = r["error"][n0], r["error"][n1]
        cells = [r["name"], _f(r["compressed"], ".0%")]
        if len(out["checkpoints"]) > 1:
            cells += [_f(e0.get("m_vs_fp32_run"), ".2e"), _f(e0.get("v_vs_fp32_run"), ".2e")]
        cells += [_f(e1.get("m_vs_fp32_run"), ".2e"), _f(e1.get("v_vs_fp32_run"), ".2e"),
                  _f(e1["m_vs_own_exact"], ".2e"), _f(e1["v_vs_own_exact"], ".2e")]
        body.append(cells)
    lines += ["", "relative L2 error of the moments over all parameters ('exact own' = fp32 "
                  "moments of the contender's own gradients):", format_table(hdr, body)]
    return "\n".join(lines)


def plot(path: str, out: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'offload[bench]')")
        return
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                 gridspec_kw=dict(height_ratios=[3, 2]))
    base = next((r["losses"] for r in out["rows"] if r["name"] == BASELINE), None)

    def smooth(ls, w):
        return [sum(ls[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1))
                for i in range(len(ls))]

    for r in out["rows"]:
        ls = r["losses"]
        steps = range(1, len(ls) + 1)
        ax.plot(steps, smooth(ls, 10), label=f"{r['name']} ({r['last50']:.4f})", lw=1.2)
        if base is not None:
            dx.plot(steps, smooth([100 * (a / b - 1) for a, b in zip(ls, base)], 25),
                    label=r["name"], lw=1.2)
    ax.axhline(out["floor"], color="k", ls=":", lw=1, label=f"entropy floor {out['floor']:.3f}")
    ax.set_ylabel("training loss (moving mean of 10)")
    ax.set_yscale("log")
    ax.set_title("fidelity: AdamW with fp32 / bf16 / 8-bit moments, same data and init")
    ax.legend(fontsize=8)
    if base is not None:
        dx.axhline(0, color="k", lw=0.8)
        for fmt, lim in TARGETS.items():
            dx.axhline(100 * (lim - 1), color="gray", ls="--", lw=0.8)
        dx.set_ylabel("loss vs fp32 moments, % (mean of 25)")
    dx.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: unknown {', '.join(unknown)} (choose from "
                         f"{','.join(CONTENDERS)})")
    size = build_size(args)
    info = offload.build_info()
    print(f"CPU: {cpu_model()}  |  kernel ISA: {info['isa']} (available: "
          f"{', '.join(info['available_isas'])})  |  torch threads {torch.get_num_threads()}, "
          f"offload threads {offload.kernels.get_num_threads()}")
    out = run(size, names, beta1=args.beta1, beta2=args.beta2, weight_decay=args.weight_decay,
              seed=args.seed, moment_step=args.moment_step, progress=not args.no_progress)
    s = out["size"]
    print(f"GPT {out['params'] / 1e3:.0f}K params (d_model {s['d_model']}, {s['n_layer']} layers, "
          f"{s['n_head']} heads, vocab {s['vocab']}, seq {s['seq']}), batch {s['batch']}, "
          f"{s['steps']} steps, lr {s['lr']:g} (warm-up {s['warmup']}, cosine to 10%), betas "
          f"{tuple(out['hyper']['betas'])}, wd {args.weight_decay}")
    print(f"stream: order-2 Markov, {s['contexts']} contexts x 8 successors; entropy floor "
          f"{out['floor']:.4f} nats (uniform {math.log(s['vocab']):.4f}); 'excess' = (loss - "
          "floor) / (fp32 loss - floor)")
    for name, why in out["skipped"].items():
        print(f"skipped {name}: {why}")
    print(tables(out))
    if out["targets"]:
        print(f"\nfidelity targets (mean loss of the last {LAST} steps, fixed seeds, one run):")
        print("\n".join("  " + t for t in out["targets"]))
    write_json(args.json, dict(machine=machine_info(), build=info, **out))
    if args.plot:
        plot(args.plot, out)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("fidelity", help="training loss with fp32 / bf16 / 8-bit Adam moments vs "
                                        "torch and peers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the test-sized run (300 steps of a 2-layer d=64 model)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="use the GPT preset of 'bench train' (e.g. small) instead of "
                        "the fidelity model")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"subset of {','.join(CONTENDERS)}")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: the size's / preset's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moment-step", dest="moment_step", type=int, default=50,
                   help="also compare the moments after this many steps (and always at the end)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument("--plot", metavar="PATH", help="loss curves as a PNG (needs matplotlib)")
    p.set_defaults(func=main)
