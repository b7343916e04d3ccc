"""bench/plots.py: ``--plot PATH`` of the benchmarks that have no chart of their own (io, step):
grouped bars, one group per operation, and the ceiling as a dashed line where one was measured.
matplotlib is optional (``pip install 'offload[bench]'``): without it the run says so and writes no
file."""
from __future__ import annotations

from typing import Optional

__all__ = ["grouped_bars", "have_matplotlib"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def grouped_bars(path: str, groups: list, series: dict, *, ylabel: str, title: str,
                 ceilings: Optional[dict] = None) -> bool:
    """``series``: name -> one value per group (None: not measured); ``ceilings``: group -> value,
    drawn as a dashed line over that group. Returns False (and says why) when matplotlib is
    missing."""
    if not have_matplotlib():
        print(f"--plot {path}: not drawn, matplotlib is not installed (pip install matplotlib, or "
              "pip install 'offload[bench]')")
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(series)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(names)) / 2), 4.5))
    for j, name in enumerate(names):
        xs = [i + j * width for i, v in enumerate(series[name]) if v is not None]
        ys = [v for v in series[name] if v is not None]
        ax.bar(xs, ys, width, label=name)
    for i, g in enumerate(groups):
        c = (ceilings or {}).get(g)
        if c:
            ax.hlines(c, i - width / 2, i + 0.8 - width / 2, colors="k", linestyles="dashed",
                      label="ceiling" if i == 0
                      or not any((ceilings or {}).get(x) for x in groups[:i]) else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    return True
