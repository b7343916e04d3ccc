"""schedule/uploads.py: UploadWaits, the compute stream waits for new weights bucket by bucket.

``step()`` of device parameters returns while the CPU worker still steps buckets and their H2D
copies run (offload/schedule/backward.py). The weights a module reads must be up before it runs: a
module forward pre-hook makes the compute stream wait for the uploads, in upload order, up to the
last bucket that holds one of the module's own parameters (or one it reads without running its
owner: schedule/owners.py); the other buckets keep uploading
during forward. Anything that needs every weight (the next backward, ``synchronize``,
``state_dict``) calls ``wait_all``. A worker failure is raised here instead of waiting forever.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Callable, Optional

import torch

from .hooks import weak_hook, weak_module_hook

__all__ = ["Upload", "UploadWaits", "compiled_code_in_use"]


def compiled_code_in_use() -> bool:
    """Has torch.compile (dynamo) compiled a frame in this process? Compiled code runs only the
    global module hooks that existed when it was traced (dynamo does not guard on them), and ours
    is registered at each step(): inside a compiled forward the per-module waits do not happen, so
    step() must wait for every upload itself. Conservative: any compiled frame counts (a compiled
    loss function too), and an unreadable counter counts as one."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return False
    try:
        return bool(utils.counters["frames"]["total"])
    except Exception:   # another torch's counters: assume compiled code
        return True

_WAIT_S = 300.0   # a hang is a bug: fail loudly instead


class Upload:
    """One bucket's upload of one step: ``issued`` is set by the worker once ``ev`` (the H2D event)
    exists, or when the bucket will never be uploaded (failure, nothing to send)."""
    __slots__ = ("bucket", "issued", "ev")

    def __init__(self, bucket: int):
        self.bucket = bucket
        self.issued = threading.Event()
        self.ev = None


class UploadWaits:
    def __init__(self, device, bucket_of_param: Callable[[int], Optional[list]],
                 error: Callable[[], None],
                 trace=None, unwritten: Optional[Callable[[int], None]] = None):
        """``bucket_of_param(id(p))``: the bucket indices holding parameter ``p`` (None if none);
        ``error()`` raises the worker's failure, if any; ``unwritten(bucket)`` raises if a
        parameter of that bucket was written since step(), i.e. before the compute stream waited
        for the bucket's upload: that write races with the upload (which may land after it and
        revert it)."""
        self.device = device
        self.bucket_of_param = bucket_of_param
        self.error = error
        self.unwritten = unwritten
        self.trace = trace
        self.seq: list = []            # Upload, in the order the worker issues them
        self.pos: dict = {}            # bucket index -> position in seq
        self.next = 0                  # seq[:next] already waited for
        self.exposed_s = 0.0           # host seconds the training thread was blocked here
        self._handle = None
        # module -> its state_dict pre-hook (see note)
        self._sd_hooks = weakref.WeakKeyDictionary()
        # module -> ids of parameters it reads but does not own
        self._claimed = weakref.WeakKeyDictionary()
        # delay_updates: completes the pending update
        self.before_read: Optional[Callable[[], None]] = None
        self.settle: Optional[Callable[[], None]] = None   # a backward raised part-way: failed

    def start(self, seq: list) -> None:
        """The uploads of a step, in issue order (those of earlier steps were all waited for)."""
        self.seq, self.next = list(seq), 0
        self.pos = {u.bucket: k for k, u in enumerate(self.seq)}
        if self.seq and self._handle is None:
            hook = weak_module_hook(self, "before_forward")
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)

    @property
    def pending(self) -> bool:
        return self.next < len(self.seq)

    def note(self, module) -> None:
        """A module seen in a forward: if it owns parameters with buckets, its ``state_dict()`` and
        ``load_state_dict()`` wait for their uploads first (pre-hooks, kept until close()).
        Frameworks save ``model.state_dict()`` right after ``step()`` (transformers' Trainer
        checkpoints, Lightning, accelerate): without the wait a checkpoint held the weights before
        the step beside the optimizer state after it; and a load right after ``step()`` could be
        overwritten by an upload landing after it."""
        if module in self._sd_hooks or not hasattr(module, "register_state_dict_pre_hook"):
            return
        if any(p is not None and self.bucket_of_param(id(p)) for p in module._parameters.values()):
            hooks = [module.register_state_dict_pre_hook(weak_hook(self, "before_state_dict"))]
            if hasattr(module, "register_load_state_dict_pre_hook"):
                hooks.append(module.register_load_state_dict_pre_hook(
                    weak_hook(self, "before_state_dict")))
            self._sd_hooks[module] = hooks

    def claim(self, module, params: list) -> None:
        """``module`` reads ``params`` (of submodules whose forward never ran, schedule/owners.py):
        its forward waits for their uploads too."""
        if params:
            self._claimed[module] = tuple(id(p) for p in params)

    def before_state_dict(self, module, *args) -> None:
        """(state_dict / load_state_dict pre-hook) the module's parameters' uploads first (with
        delay_updates, the pending update too: schedule/delayed.py). A backward that stepped
        buckets and raised fails the step first (``settle``): no upload of it lands after the
        weights are loaded."""
        if self.settle is not None:
            self.settle()
        if self.before_read is not None:
            self.before_read()
        if self.pending:
            self.before_forward(module)

    def close(self) -> None:
        self.remove_hook()
        for hooks in list(self._sd_hooks.values()):
            for handle in hooks:
                handle.remove()
        self._sd_hooks = weakref.WeakKeyDictionary()
        self._claimed = weakref.WeakKeyDictionary()

    def before_forward(self, module, args=None) -> None:
        self.note(module)
        need = -1
        ids = [id(p) for p in module._parameters.values() if p is not None]
        for pid in ids + list(self._claimed.get(module, ())):
            for bi in self.bucket_of_param(pid) or ():
                k = self.pos.get(bi, -1)
                if k > need:
                    need = k
        if need >= self.next:
            self.wait_upto(need)

    def wait_upto(self, k: int) -> None:
        """The compute stream waits for the uploads seq[next .. k] (host-blocked until each is
        issued)."""
        t0 = time.perf_counter()
        try:
            while self.next <= k:
                u = self.seq[self.next]
                deadline = time.perf_counter() + _WAIT_S
                while not u.issued.wait(0.05):
                    self.error()
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"offload: the upload of bucket {u.bucket} was not "
                                           f"issued within {_WAIT_S} s")
                self.error()
                if self.unwritten is not None:
                    self.unwritten(u.bucket)
                if u.ev is not None:
                    self.device.wait(u.ev)
                self.next += 1
        finally:
            t1 = time.perf_counter()
            self.exposed_s += t1 - t0
            if self.trace is not None and t1 - t0 > 0:
                self.trace.span(f"wait weights up to #{k}", "training thread", (t0, t1))
            if not self.pending:
                self.remove_hook()

    def wait_all(self) -> None:
        if self.pending:
            self.wait_upto(len(self.seq) - 1)

    def abandon(self, current: tuple = ()) -> None:
        """The worker failed (reported) and is idle: nothing more will be uploaded. The compute
        stream still waits for the uploads issued before the failure, so that none lands after a
        later write (the user restoring the weights); an upload that failed itself is part of the
        failure reported. ``current``: the uploads of a step still in backward (not handed to
        ``start`` yet), waited for too."""
        for u in list(self.seq[self.next:]) + list(current):
            if u.issued.is_set() and u.ev is not None:
                try:
                    self.device.wait(u.ev)
                except Exception:   # (its error is the one reported)
                    pass
        self.next = len(self.seq)
        self.remove_hook()

    def remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
