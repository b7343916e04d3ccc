"""checkpoint/async_.py: ``offload.save_async`` - save in a background thread.

The optimizer's next ``step()`` (the only thing that changes the state) waits for the files
through a step pre-hook, so a checkpoint is never a mix of two steps. A failed save raises its
error once (at the next step/save/load or ``result()``), then is forgotten. The background save
holds only the state tensors it writes (never the optimizer: ``del opt`` frees it, and the state
is released when the save ends). At interpreter exit, pending saves are finished and committed
before Python finalizes; a save that failed and whose error nobody saw is reported on stderr.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import sys
import threading
import weakref
from typing import Optional

from . import adapter, pending
from .format import DEFAULT_CHUNK
from .save import Saver


class SaveHandle:
    """Result of :func:`save_async`: ``result()`` waits (and, when distributed, commits: every rank
    must call it, which the step pre-hook does) and raises if the save failed; ``done()``;
    ``await handle`` in asyncio code."""

    def __init__(self, saver: Saver, target):
        self._saver = saver
        self._dir = saver.dir
        self._world = saver.world
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.RLock()
        self._committed = False
        self._delivered = False
        self._error: Optional[BaseException] = None
        self._target = weakref.ref(target)
        self._hook = None

    def done(self) -> bool:
        """True once this rank's files are written (distributed: the commit still happens in
        result())."""
        return self._future.done()

    def _settle(self, timeout: Optional[float]) -> None:
        """Wait for the files; commit when distributed. Records (does not raise) the save's
        error."""
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except BaseException as e:
            with self._lock:
                self._error = self._error or e
        with self._lock:
            if self._error is None and not self._committed:
                if self._world > 1:
                    try:
                        with pending.dir_lock(self._dir):
                            self._saver.commit()
                    except BaseException as e:
                        self._error = e
                self._committed = True
            self._saver = None  # nothing of the optimizer is referenced any longer

    def _forget(self) -> None:
        target = self._target()
        pending.unregister(target, self)
        pending.spend_hook(target, self._hook)
        self._hook = None

    def _deliver(self) -> None:
        """From the step pre-hook and save/load: raise a failure once, then forget this save."""
        self._settle(None)
        with self._lock:
            err, first = self._error, not self._delivered
            self._delivered = True
            self._forget()
        if err is not None and first:
            raise err

    def result(self, timeout: Optional[float] = None) -> str:
        """The checkpoint directory once committed; raises the save's error if it failed."""
        self._settle(timeout)
        with self._lock:
            self._delivered = True
            self._forget()
            target = self._target()
        if target is not None:
            pending.remove_spent_hooks(target)
        if self._error is not None:
            raise self._error
        return self._dir

    wait = result

    def _step_pre_hook(self, *_args, **_kwargs) -> None:
        if not self._delivered:
            self._deliver()

    def __await__(self):
        try:
            yield from asyncio.wrap_future(self._future).__await__()
        except BaseException:
            pass  # result() raises it
        return self.result()


def _work(handle: SaveHandle, saver: Saver) -> None:
    try:
        with pending.dir_lock(saver.dir):
            try:
                saver.write_rank_files()
            except BaseException:
                saver.abandon()
                raise
            finally:
                saver.release()  # the state tensors (and a kept-open NVMe store) are let go here
            if saver.world == 1:
                saver.commit()
        handle._future.set_result(saver.dir)
    except BaseException as e:
        handle._future.set_exception(e)
    if saver.world == 1 and handle._future.exception() is None:
        with handle._lock:
            handle._committed = True
            handle._saver = None
            # success: nothing left to deliver; the spent hook is removed at the next call
            pending.unregister(handle._target(), handle)


_exit_registered = False


def _at_exit() -> None:
    """Finish every pending save before the interpreter finalizes; report failures nobody saw."""
    for h in list(pending.live):
        try:
            h._settle(None)
        except BaseException as e:  # pragma: no cover - _settle records errors
            h._error = h._error or e
        if h._error is not None and not h._delivered:
            e = h._error
            print(f"offload: save_async into {h._dir} failed: {type(e).__name__}: {e}\noffload: "
                  f"that checkpoint was NOT committed; the previous checkpoint in {h._dir} "
                  "(if any) is intact", file=sys.stderr, flush=True)
        pending.live.discard(h)


def save_async(optimizer, directory, *, group=None, chunk_bytes: int = DEFAULT_CHUNK,
               progress: Optional[bool] = False) -> SaveHandle:
    """Start saving in a background thread and return a :class:`SaveHandle` at once.

    Training may run forward and backward meanwhile; the optimizer's next ``step()`` waits until
    the state is written, so the checkpoint is never a mix of two steps. Non-distributed saves
    commit in the background; distributed ones commit in ``result()`` (called by that hook on
    every rank). Pending saves are completed at interpreter exit.
    """
    global _exit_registered
    pending.deliver(optimizer, group)
    target = adapter.resolve(optimizer, group)[0]
    if adapter.in_gpu_mode(target):
        raise NotImplementedError("save_async with GPU offload: the engine may update the state "
                                  "during backward (not only in step()), so a background save "
                                  "could mix two steps; use offload.save")
    saver = Saver(optimizer, directory, group=group, chunk_bytes=chunk_bytes, progress=progress)
    handle = SaveHandle(saver, target)
    handle._hook = target.register_step_pre_hook(handle._step_pre_hook)
    pending.register(target, handle)
    if not _exit_registered:
        # registered late: runs before handlers registered earlier (torch's)
        atexit.register(_at_exit)
        _exit_registered = True
    threading.Thread(target=_work, args=(handle, saver), name="offload-save", daemon=False).start()
    return handle
