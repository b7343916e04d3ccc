"""kernel_util.py: helpers of the native Adam kernel tests (test_kernel_bitwise.py, test_kernel_inputs.py,
test_kernel_moments.py): the dtypes and Adam variants, a random state and one kernel call on it, and the
bitwise comparison; inputs with NaNs, infinities, subnormals and signed zeros."""
import torch

from offload import kernels

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# (decoupled, amsgrad, maximize, weight_decay): Adam and AdamW x every flag combination
VARIANTS = [(d, a, m, wd) for d in (True, False) for a in (False, True) for m in (False, True) for wd in (0.0, 0.1)]


def make_state(n, gdtype, odtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    vmax = v + torch.rand(n, generator=gen) * 0.01
    g = (torch.randn(n, generator=gen) * 3).to(gdtype)
    out = torch.empty(n, dtype=odtype) if odtype is not None else None
    return [p, m, v, vmax, g, out]


def run(state, variant, step=3, reference=False, threads=0, mult=1.0, lr=1e-2):
    p, m, v, vmax, g, out = state
    decoupled, amsgrad, maximize, wd = variant
    kernels.adam_step([p], [g], [m], [v], [vmax], [step], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=wd, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize,
                      grad_multiplier=mult, outs=[out] if out is not None else None,
                      threads=threads, reference=reference)


def clone(state):
    return [t.clone() if t is not None else None for t in state]


def assert_bitwise(a, b):
    for x, y in zip(a, b):
        if x is None:
            continue
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))


def nonfinite_inputs(n, seed):
    """(p, g): randn, with NaNs of both signs and assorted payloads, infinities, subnormals and signed
    zeros at scattered places, never a NaN in both at one element (which of two NaNs an IEEE
    operation returns is up to the compiler's operand order)."""
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    words = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA12345, 0x7F800000, 0xFF800000, 0x00000001,
             0x807FFFFF, 0x80000000, 0x00000000]
    special = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)
    where = torch.randperm(n, generator=gen)[: 2 * (n // 5)]
    half = where.numel() // 2
    for t, idx in ((p, where[:half]), (g, where[half:])):
        t[idx] = special[torch.randint(len(words), (idx.numel(),), generator=gen)]
    return p, g
