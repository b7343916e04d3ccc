"""base/tensors.py: the checks a tensor passes before its address may reach C++, and its signature.

``check_tensor`` (type, layout, device, dtype, contiguity, shape, neg/conj bits, storage bounds),
``check_storage`` (the view lies inside its storage), ``check_no_overlap`` (nothing written shares
bytes with anything else), ``tensor_signature`` (what a cached pointer-table row depends on) and
``ptr`` (the address, 0 for none), ``bump_versions`` (what an in-place torch op does to the version
counter, for memory written through an address). Used by offload/native/ before every native call
and by the parameter checks of offload/params/.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["bump_versions", "check_storage", "check_tensor", "check_no_overlap", "ptr",
           "tensor_signature"]


def check_storage(t: torch.Tensor, name: str) -> None:
    """Raise unless every element of the view ``t`` lies inside its storage.

    A view can outgrow its storage: ``t.untyped_storage().resize_(16)``, or a storage shrunk
    under a gradient. torch's own kernels check this; a raw pointer handed to C++ does not.
    """
    if t.numel() == 0:
        return
    try:
        st = t.untyped_storage()
        nbytes = st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise RuntimeError(f"{name} has no accessible storage ({e}); offload needs "
                           "plain CPU tensors") from None
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    need = (last + 1) * t.element_size()
    if t.storage_offset() < 0 or min(t.stride(), default=0) < 0 or need > nbytes:
        raise RuntimeError(f"{name} reaches byte {need} of its storage, but the storage holds "
                           f"only {nbytes} bytes (was its untyped_storage() resized or set_() to "
                           "a smaller one?); the native kernel would read or write out of "
                           "bounds. Give it a tensor whose storage covers the view.")


def tensor_signature(t: torch.Tensor) -> tuple:
    """Everything about ``t`` that a pointer table depends on, as a comparable tuple.

    (data_ptr, storage data_ptr, storage nbytes, storage_offset, shape, strides, dtype, device,
    neg bit, conj bit). Any change a user can make that matters to a cached table row
    (``p.data = p.data[:1000]`` keeping the data pointer, ``t_()``, a reshape, a storage
    ``resize_``/``set_``, a dtype view) changes the signature. In-place value writes do not
    (see ``t._version`` for those).
    """
    try:
        st = t.untyped_storage()
        sptr, snb = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        sptr, snb = -1, -1
    return (t.data_ptr(), sptr, snb, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype, t.device, t.is_neg(), t.is_conj())


def check_tensor(t: torch.Tensor, name: str, *, dtypes=(torch.float32,),
                 numel: Optional[int] = None, shape: Optional[torch.Size] = None) -> torch.Tensor:
    """Raise a clear exception unless ``t`` is a dense, contiguous CPU tensor we may hand to C++.

    Checks type, layout, device, dtype, contiguity, shape/numel, the neg/conj bits (their values
    are not what the memory holds) and that the view lies inside its storage.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise RuntimeError(f"{name} is {t.layout}: offload does not support sparse tensors")
    if t.device.type != "cpu":
        raise RuntimeError(f"{name} is on {t.device}; the native kernel works on CPU tensors")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected "
                        f"one of: {names}")
    if not t.is_contiguous():
        raise RuntimeError(f"{name} is not contiguous (strides {tuple(t.stride())}); "
                           "offload never updates a temporary copy: make it contiguous first")
    if t.is_neg() or t.is_conj():
        raise RuntimeError(f"{name} is a lazy {'negative' if t.is_neg() else 'conjugate'}-bit "
                           "view: its memory does not hold its values; call .resolve_neg() / "
                           ".resolve_conj() first")
    if shape is not None and t.shape != shape:
        raise RuntimeError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if numel is not None and t.numel() != numel:
        raise RuntimeError(f"{name} has {t.numel()} elements, expected {numel}")
    check_storage(t, name)
    return t


def check_no_overlap(written, read=()) -> None:
    """ValueError if a written tensor's bytes overlap any other tensor's (reads may share memory).

    ``written``/``read``: (name, tensor) pairs of contiguous tensors.
    """
    spans = []
    for is_written, seq in ((True, written), (False, read)):
        for name, t in seq:
            if t is not None and t.numel() > 0:
                start = t.data_ptr()
                spans.append((start, start + t.numel() * t.element_size(), is_written, name))
    spans.sort(key=lambda x: x[0])
    reach_any = reach_written = None  # (end, name) of the furthest-reaching span so far
    for start, end, is_written, name in spans:
        other = reach_any if is_written else reach_written
        if other is not None and start < other[0]:
            raise ValueError(f"{name} overlaps {other[1]} in memory and one of them is written by "
                             "the update; give each parameter and state its own memory")
        if reach_any is None or end > reach_any[0]:
            reach_any = (end, name)
        if is_written and (reach_written is None or end > reach_written[0]):
            reach_written = (end, name)


def ptr(t: Optional[torch.Tensor]) -> int:
    """The address of ``t``'s first element; 0 for None or an empty tensor (the native tables'
    "absent")."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def bump_versions(tensors: list) -> None:
    """Raise the version counter of every tensor in ``tensors`` by one, as an in-place torch op on
    it would: memory the native kernel wrote through an address is then seen as modified by
    autograd (a backward through values saved before the write raises, as it does after torch's
    own optimizers) and by anything else that watches ``_version``."""
    if not tensors:
        return
    try:
        torch.autograd.graph.increment_version(tensors)   # a sequence, in one call (recent torch)
    except TypeError:
        for t in tensors:   # torch versions whose increment_version takes one tensor
            torch.autograd.graph.increment_version(t)
