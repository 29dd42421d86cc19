"""The size-scaling figure: how save and restore times grow with the state's size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

STYLE = {"minickpt": ("C0", "o", "-"), "orbax": ("C1", "s", "-"),
         "limit": ("0.35", "", "--"), "memcpy": ("0.6", "", ":")}
NAMES = {"save": {"minickpt": "minickpt save", "orbax": "Orbax save",
                  "limit": "write + fsync (limit)", "memcpy": "host memcpy"},
         "restore": {"minickpt": "minickpt restore", "orbax": "Orbax restore",
                     "limit": "read (limit)", "memcpy": "host memcpy"}}


def plot_scaling(points: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    """Two log-log panels (save, restore): median time against state size, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, phase in zip(axes, ("save", "restore"), strict=True):
        for who in ("minickpt", "orbax", "limit", "memcpy"):
            xs, ys = [], []
            for p in points:
                v = p.get(phase, {}).get(who) if who != "memcpy" else p.get("memcpy")
                if v is not None and v > 0:
                    xs.append(p["nbytes"])
                    ys.append(v * 1e3)
            if not xs:
                continue
            color, marker, ls = STYLE[who]
            ax.plot(xs, ys, marker=marker or None, linestyle=ls, color=color,
                    label=NAMES[phase][who])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state size (bytes, 50 float32 leaves)")
        ax.set_title(phase)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("median time (ms)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
