"""engine/engine.py: StateEngine, the composition root: one layout, one state tier, one parameter
side, and the torch-layout views of the state (``views``, engine/torchstate.py TorchViews).

It is what ``offload.Adam/AdamW`` hold in every mode (host or device parameters, FSDP2 local
shards, any tier and moment format): it validates a step's gradients before any I/O, runs the
pipeline (engine/pipeline.py) over the buckets that have gradients, installs torch-layout views of
the state in ``opt.state`` and serves ``state_dict`` / ``load_state_dict`` bucket by bucket. It
never reads the optimizer's private attributes: hyperparameters come through ``hyper(group)``. The
device schedule steps buckets itself, through the names StateEngine's docstring lists for it.
"""
from __future__ import annotations

import functools
import operator
import os
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch

from ..base.dist import local
from ..params.guards import WriteTracker, check_overlaps, refresh_master
from ..state.layout import build_layout, piece_columns
from ..params.base import shapes_of
from ..params import ParamSide, side_maker
from ..state import make_tier
from ..state.tier import check_budget, check_depth, split_budget
from ..base.units import parse_size
from . import fastpath, grow, pipeline
from ..moments.format import MomentFormat, moment_format
from ..moments.handouts import Handouts
from .registry import Registry
from .exclusive import check_process as _check_process, exclusive as _exclusive
from .torchstate import TorchViews

__all__ = ["StateEngine"]


def _moment_format(numels: list, moments: MomentFormat, min_size: int, gi: int, i: int):
    return moments.for_size(numels[gi][i], min_size)


class StateEngine:
    """The optimizer state of one optimizer: its layout, tier and parameter side.

    The device schedule (offload/schedule/) steps buckets itself and reads of the engine these
    names only (tests/test_schedule_seam.py): what is stepped, ``groups`` (its per-group lists
    ``dtypes`` and ``numels``), ``excluded``, ``mode``, ``layout``, ``registry``, ``side``,
    ``tier`` and ``depth``; a step, under ``lock``: ``check_groups()``, ``reserve()``,
    ``adopt()``, ``collect()``, ``commit()`` or ``step()``, its ``telemetry`` and ``last_stats``;
    parameters written by the user: ``reload_masters()`` and ``holds_moment_copies()``.
    """

    def __init__(self, groups: list, amsgrad: list, *, mode: str, nvme_dir=None,
                 host_budget="2GiB",
                 keep: bool = False, side: Callable[[list, list], ParamSide] = side_maker(),
                 bucket_bytes: Optional[int] = None,
                 depth: int = 2, queue_depth: int = 8, block_size: int = 1 << 20,
                 direct: bool = True,
                 moments: str = "fp32", moments_min_size: int = 4096, exclude=()):
        self.mode = mode
        # (gi, i) stepped elsewhere (device-side small params): no state here
        self.excluded = set(exclude)
        self.moments, self.moments_min_size = moment_format(moments), int(moments_min_size)
        self.budget = parse_size(host_budget)
        self.depth = depth
        self.groups = [list(g) for g in groups]
        self.amsgrad = [bool(a) for a in amsgrad]
        self.dtypes = [[local(p).dtype for p in ps] for ps in self.groups]
        self.numels = [[local(p).numel() for p in ps] for ps in self.groups]
        self.local_groups = [[local(p) for p in ps] for ps in self.groups]
        # a parameter listed twice...: before any file exists
        check_overlaps(self.local_groups, (), None, mode)
        # the state (file, I/O threads, mapping) belongs to this process
        self._pid = os.getpid()
        # step / state access / close never overlap (close waits); the device worker holds it per
        # bucket
        self.lock = threading.RLock()
        # bf16/fp16 params written by the user between steps
        self.tracker = WriteTracker(self.local_groups)
        self.tracker.dtypes = self.dtypes
        self._side: ParamSide = side(self.groups, self.dtypes)   # for the engine's life: ``side``
        check_depth(depth)
        # depth reads ahead per drive: every drive has reads in flight (docs/nvme.md)
        if mode == "nvme":
            from ..state.drives import parse_dirs
            self.depth = depth = min(64, depth * len(parse_dirs(nvme_dir)))
        nstage = self.side.staging_slots
        self.state_cap, self.stage_cap = split_budget(mode, self.budget, depth, nstage)
        check_budget(mode, self.state_cap, depth, nstage, host_budget)
        self.stage_cap = self.side.stage_cap(self.stage_cap, bucket_bytes)
        self.layout = self.lay_out(self.groups, 0)
        self.registry = Registry([len(g) for g in self.groups])
        self.tier = make_tier(mode, nvme_dir=nvme_dir, keep=keep, depth=depth,
                              queue_depth=queue_depth,
                              block_size=block_size, direct=direct, budget=self.budget)
        self.tier.allocate(self.layout)
        self.side.allocate(self.layout)
        self.telemetry = dict(steps=0, kernel_s=0.0, step_s=0.0)
        self.last_stats: Optional[dict] = None
        self._grads = None   # the gradients collect() checked, for the step that follows it
        self.plans = fastpath.PlanHolder()   # the next step, planned (engine/fastpath.py)
        # (bound to what they read, not to the engine: the views hold no reference back to it)
        self._format = functools.partial(_moment_format, self.numels, self.moments,
                                         self.moments_min_size)
        self._exclusive = functools.partial(_exclusive, self.lock, self._pid, self.tier, mode,
                                            self.plans)
        self.views = TorchViews(self.layout, self.tier, self.registry, self.groups, Handouts(),
                                local_groups=self.local_groups, numels=self.numels,
                                amsgrad=self.amsgrad,
                                moment_format=self._format, all_masters=self.side.all_masters,
                                mode=mode,
                                tracker=self.tracker, exclusive=self._exclusive,
                                read_master=self.side.read_master)

    def lay_out(self, groups: list, first_group: int):
        """The layout of parameter lists ``groups`` (numbered from ``first_group``); excluded ones
        get none."""
        shapes = shapes_of(groups, self.side.all_masters, first_group)
        if self.excluded:
            from dataclasses import replace
            shapes = [replace(s, active=False) if (s.group, s.index) in self.excluded else s
                      for s in shapes]
        return self.layout_of(shapes)

    def layout_of(self, shapes: list):
        """The layout of ``shapes`` (offload/state/layout.py Shape) with this engine's budgets; its
        moment format for parameters of at least ``moments_min_size`` elements, fp32 below."""
        from dataclasses import replace
        fmt, least = self.moments, self.moments_min_size
        shapes = [replace(s, moments=fmt.for_size(s.numel, least)) for s in shapes]
        return build_layout(shapes, amsgrad=self.amsgrad, max_state_bytes=self.state_cap,
                            max_param_bytes=self.stage_cap, stagger=self.mode == "ram")

    # ------------------------------------------------------------------ shape of the engine
    def add_group(self, params: list, amsgrad: bool) -> None:
        """``add_param_group``: lay the new group out after the existing state and grow the
        file."""
        with self.exclusive():
            grow.add_group(self, params, amsgrad)

    def append_group(self, params: list, amsgrad: bool) -> None:
        """Group ``params`` at the end of the per-group lists (the tracker's too), in place: the
        views and the tracker hold the same lists (engine/grow.py add_group)."""
        self.groups.append(list(params))
        self.local_groups.append([local(p) for p in params])
        self.tracker.add_group(len(params))
        self.amsgrad.append(bool(amsgrad))
        self.dtypes.append([local(p).dtype for p in params])
        self.numels.append([local(p).numel() for p in params])

    def drop_groups(self, gi: int) -> None:
        """Undo append_group and Registry.grow from group ``gi`` on, and the layout's entries of
        those groups (its buckets: Layout.truncate)."""
        for per_group in (self.groups, self.local_groups, self.amsgrad, self.dtypes, self.numels):
            del per_group[gi:]
        self.tracker.drop_groups(gi)
        self.registry.drop_groups(gi)
        self.layout.drop_groups(gi)

    def exclusive(self, failed_ok: bool = False):
        """Context manager for exclusive use: the right process, ``lock`` held, not closed, not
        failed (``failed_ok``: a load that replaces the whole state may run on a failed tier);
        close() waits for it."""
        return self._exclusive(failed_ok)

    @property
    def pieces(self) -> dict:
        return {k: [(self.layout.buckets[bi], pc) for bi, pc in v] for k, v in self.layout.of_param.items()}

    @property
    def side(self) -> ParamSide:
        """Where the parameters are (params/side.py), built with the engine; never replaced."""
        return self._side

    # ------------------------------------------------------------------ step
    def holds(self, params: list, amsgrad: list) -> bool:
        """Laid out for exactly these parameter lists (by identity) and amsgrad settings (None: any)."""
        return (amsgrad is None or amsgrad == self.amsgrad) and len(params) == len(self.groups) and all(
            len(ps) == len(mine) and all(map(operator.is_, ps, mine)) for ps, mine in zip(params, self.groups))

    def check_groups(self, groups: list, amsgrad: bool = False) -> None:
        """A guard: laid out for these groups (``amsgrad``: their settings too), or raise."""
        flags = [bool(g["amsgrad"]) for g in groups] if amsgrad else None
        if not self.holds([g["params"] for g in groups], flags):
            raise RuntimeError("a param group's 'params' list or amsgrad changed since the last "
                               "step: call opt.synchronize() after changing them, before the next "
                               "backward (the state is laid out for them again there)")

    def collect(self, param_groups: list, keep_grads: bool = True, state=None) -> list:
        """Validate grads/params of every group (before any I/O), under ``lock``; lay out the state
        of parameters that have a gradient for the first time (their entries in ``state``,
        opt.state, if any, are their state). Returns per group the bool mask of the parameters with
        a gradient.
        ``keep_grads``: the checked gradients are what the next ``step(..., active=...)`` uses;
        False (the device worker captures its own): none is kept."""
        with self.lock:
            active = self._collect(param_groups, state)
            if not keep_grads:
                self._grads = None
            return active

    def adopt(self, state: dict) -> None:
        """The user's edits of ``opt.state`` (``state``) since the last step honoured now, as torch
        would (TorchViews.adopt_user_state): before a step the device schedule runs itself, and
        before the state is handed out (``state_dict()``, a checkpoint)."""
        with self.exclusive():
            self.views.adopt_user_state(state)

    def commit(self, active: list, fresh: list, state: dict) -> None:
        """After every bucket of a step: the parameters ``active`` (per group, bool masks) have
        state and their writes are tracked from here; ``fresh`` ([(gi, i)]: state created by this
        step) get their views in ``state`` (opt.state), and held decoded moments their new values.
        Call under ``lock``."""
        self.registry.commit(active)
        for gi, a in enumerate(active):
            self.tracker.record(gi, np.flatnonzero(a))
        self.views.install(fresh, state)   # (the step is done: opt.state must show it, or the tier fails)

    def _collect(self, param_groups: list, state=None) -> list:
        """collect() without the lock: per group, the bool mask of active params."""
        self.check_groups(param_groups)
        for gi, group in enumerate(param_groups):
            if bool(group["amsgrad"]) != self.amsgrad[gi]:
                raise ValueError(f"group {gi}: amsgrad cannot change after construction with storage={self.mode!r}")
        active, grads = self.side.collect(self.groups, self.local_groups, self.dtypes, self.numels,
                                          self.tier.own_memory(), self.mode)
        self._grads = grads   # the step uses exactly the tensors checked here
        unplaced = self.layout.unplaced
        grow.lay_out_late(self, [(gi, int(i)) for gi, a in enumerate(active)
                                 for i in np.flatnonzero(a & unplaced(gi, self.numels[gi]))], state)
        return active

    def reserve(self, keys: list) -> bool:
        """Lay out the state of those of ``keys`` ([(gi, i)] with none yet: frozen at construction)
        that are unfrozen now or have a gradient, before a step that may need it starts; nothing
        changes if it cannot grow. True when any was laid out."""
        late = [(gi, i) for gi, i in keys if self.groups[gi][i].requires_grad or self.groups[gi][i].grad is not None]
        if late:
            with self.exclusive():
                grow.lay_out_late(self, late)
        return bool(late)

    def _jobs(self, active: list, order=None) -> list:
        jobs = []
        buckets = self.layout.buckets if order is None else order
        for b in buckets:   # Python per bucket; per piece only for buckets stepped in part
            mask = active[b.group][piece_columns(b, b.pieces, "param")[0]]
            if mask.all():
                act = b.pieces
            elif mask.any():
                act = [pc for pc, m in zip(b.pieces, mask.tolist()) if m]
            else:
                continue
            jobs.append((b, act, self.registry.has_state(b)))
        return jobs

    def step(self, param_groups: list, hyper: Callable[[int], dict], state: dict, mult: float,
             threads: int, active: Optional[list] = None) -> None:
        _check_process(self._pid, self.mode)
        with self.lock:
            try:
                done = self._step(param_groups, hyper, state, mult, threads, active)
                if active is None:   # (host parameters: the next step may run as this one did)
                    self.plans.plan = fastpath.StepPlan.build(self, done)
            finally:
                self._grads = self.side.grads = None   # no reference to this step's gradients survives it

    def step_planned(self, param_groups: list, hyper: Callable[[int], dict], state: dict,
                     mult: float, threads: int) -> bool:
        """:meth:`step` as the last one ran, where nothing it depends on changed
        (engine/fastpath.py); else False, and nothing changed."""
        _check_process(self._pid, self.mode)
        return self.plans.run(self, param_groups, hyper, state, mult, threads)

    def _step(self, param_groups, hyper, state, mult, threads, active) -> list:
        self.plans.plan = None
        self.tier.check_usable()
        self.views.adopt_user_state(state)
        if active is None:
            active = self._collect(param_groups, state)
            self.views.follow_shapes(state, self.side.revalidated())
        hypers = {gi: hyper(gi) for gi, a in enumerate(active) if a.any()}   # validated before any change
        for gi, h in hypers.items():
            fastpath.check_finite(gi, h)
        self.side.grads = self._grads
        resync = self.side.user_writes(self.tracker, self.registry.ready)
        t0 = time.perf_counter()
        tel = self.tier.telemetry
        io0 = tel["read_wait_s"] + tel["write_wait_s"]
        k0 = self.telemetry["kernel_s"]
        jobs = self._jobs(active)
        try:
            self.registry.advance(active)
            self.side.begin()
            pipeline.run(jobs, tier=self.tier, side=self.side, registry=self.registry,
                         hyper=hypers.__getitem__, mult=mult, threads=threads, depth=self.depth,
                         ahead=self.side.staging_slots,
                         timing=self.telemetry, resync=resync and self._resync(resync))
            self.side.stepped(active)   # host: the kernel wrote them through their addresses (versions up)
            fresh = [(gi, i) for gi, a in enumerate(active) for i in np.flatnonzero(a & ~self.registry.ready[gi])]
            self.commit(active, fresh, state)
        except BaseException as e:
            self.tier.fail(e)
            raise
        dt = time.perf_counter() - t0
        self.telemetry["steps"] += 1
        self.telemetry["step_s"] += dt
        self.last_stats = dict(step=self.telemetry["steps"], kernel_s=self.telemetry["kernel_s"] - k0,
                               nvme_s=tel["read_wait_s"] + tel["write_wait_s"] - io0, step_s=dt,
                               buckets=len(jobs), skipped=False, grad_multiplier=mult)
        return active

    def _resync(self, which: set):
        """A bf16/fp16 parameter written by the user since its last step: its new values go into
        the master where they differ from the rounded master (offload/params/guards.py), before the
        kernel reads it."""
        def apply(b, pieces, blk) -> None:
            if not b.master:
                return
            f32 = blk.data[:b.nbytes].view(torch.float32)
            for pc in pieces:
                if (b.group, pc.param) in which:
                    sec = b.section("master_param") // 4 + pc.pos
                    refresh_master(f32[sec:sec + pc.n],
                                  self.local_groups[b.group][pc.param].detach().reshape(-1)[pc.start:pc.start + pc.n])
        return apply

    def io_pass(self) -> float:
        """Benchmark helper: the seconds to read and write back every bucket through the step's
        pipeline without computing (data unchanged): the I/O-only time of a full step."""
        with self.exclusive():
            return self._io_pass()

    def _io_pass(self) -> float:
        if self.mode != "nvme":
            raise RuntimeError("io_pass() measures the nvme pipeline")
        saved = dict(self.tier.telemetry)
        t = time.perf_counter()
        try:
            pipeline.run([(b, b.pieces, True) for b in self.layout.buckets], tier=self.tier, side=self.side,
                         registry=self.registry, hyper=None, mult=1.0, threads=0, depth=self.depth,
                         ahead=1, timing={}, compute=False)
        except BaseException as e:
            self.tier.fail(e)
            raise
        dt = time.perf_counter() - t
        self.tier.telemetry.clear()
        self.tier.telemetry.update(saved)
        return dt

    # ------------------------------------------------------------------ the torch-layout state (TorchViews)
    def torch_state(self, gi: int, i: int) -> dict:
        """``state[p]`` for parameter ``i`` of group ``gi``: step counter and views of the moments."""
        return self.views.torch_state(gi, i)

    def state_tensors(self) -> dict:
        """(gi, i) -> {key: fp32 tensor} for every parameter that has state (views, never copies)."""
        return self.views.state_tensors()

    def raw_state_tensors(self) -> dict:
        """(gi, i) -> {key: tensor} in the stored form (compressed moments under ``<key>.<format>``)."""
        return self.views.raw_state_tensors()

    def load(self, entries: dict) -> None:
        """Replace the whole state by ``entries`` ((gi, i) -> state dict); also the way back after a failure."""
        self.views.load(entries, self.side.read_master)

    def reload_masters(self, which: set) -> None:
        """Re-read the fp32 master of the parameters ``which`` ({(gi, i)}) that have state, from the parameters."""
        self.views.reload_masters(which, self.side.read_master)

    def holds_moment_copies(self) -> bool:
        """A caller holds decoded compressed moments from opt.state (moments/handouts.py)."""
        return self.views.holds_moment_copies()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for outstanding I/O, release buffers and delete the state (unless ``keep``). A step
        in another thread finishes first; in a fork()ed child only the child's descriptors are
        closed."""
        if os.getpid() != self._pid:
            self.tier.close()
            return
        with self.lock:
            self.side.close()
            self.tier.close()

    def info(self) -> dict:
        d = dict(self.tier.info())
        d.update(self.telemetry)
        d.update(mode=self.mode, depth=self.depth, host_budget=self.budget, buckets=len(self.layout.buckets),
                 file_bytes=getattr(self.tier, "file_bytes", self.layout.nbytes))
        d.update(self.side.info(self.layout))
        return d
