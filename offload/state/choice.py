"""state/choice.py: which storage the user asked for: ``storage="ram"|"nvme"|"mmap"``, its
deprecated alias ``state`` (accepted with a DeprecationWarning), and the default when neither is
given ("nvme" when only ``nvme_dir`` says where, else "ram"), and what a storage accepts
(:func:`check_storage`). Read by the optimizer's constructor and by ``offload.plan()``, so that
both refuse the same settings.
"""
from __future__ import annotations

import warnings
from typing import Optional

__all__ = ["resolve_state", "resolve_storage", "check_storage", "STORAGES"]

STORAGES = ("ram", "nvme", "mmap")


def resolve_state(state: Optional[str], nvme_dir) -> str:
    """``state`` as given, or the default: "nvme" when only ``nvme_dir`` says where, else "ram"."""
    if state is None:
        return "nvme" if nvme_dir is not None else "ram"
    return state


def resolve_storage(storage: Optional[str], state: Optional[str], nvme_dir, *,
                    stacklevel: int = 4) -> str:
    """Where the state lives: ``storage``, or ``state`` (deprecated alias: DeprecationWarning), or
    the default of :func:`resolve_state`. ``stacklevel`` points the warning at the caller's
    constructor call."""
    if state is not None:
        warnings.warn(f"state={state!r} is deprecated: the argument is now called storage "
                      f"(storage={state!r}); state= will be removed in the next release",
                      DeprecationWarning, stacklevel=stacklevel)
        if storage is not None and storage != state:
            raise ValueError(f"storage={storage!r} and state={state!r} disagree: pass storage= "
                             "only (state= is its old name)")
        storage = state
    return resolve_state(storage, nvme_dir)


def check_storage(storage, nvme_dir, nvme_options=None) -> None:
    """Refuse what ``storage`` cannot take: an unknown name; ``nvme_dir`` (or NVMe tuning beyond
    ``staging_slots``) with RAM state; several drives for mmap state (one mapped file)."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be 'ram', 'nvme' or 'mmap', got {storage!r}")
    given = [k for k, v in (("nvme_dir", nvme_dir is not None),
                            ("nvme_options", set(nvme_options or ()) - {"staging_slots"})) if v]
    if storage == "ram" and given:
        ring = (" (with storage='ram', nvme_options={'staging_slots': n} sizes the staging ring "
                "of device parameters)") if "nvme_options" in given else ""
        raise ValueError(f"{' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} to "
                         f"storage='nvme' or storage='mmap'{ring}")
    if storage == "mmap":
        from .drives import check_one
        check_one(nvme_dir, "mmap")
