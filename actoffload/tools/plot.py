"""``actoffload demo --plot FILE.png``: memory over one step, and bytes offloaded per group.

matplotlib is an optional extra (``pip install 'actoffload[plot]'``); everything else in
actoffload works without it.
"""

from __future__ import annotations

from typing import Any

from .steptrace import StepTrace

MiB = 1 << 20


def require_matplotlib() -> Any:
    """matplotlib's pyplot on a file-only backend; ``ImportError`` saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib, an optional extra: pip install 'actoffload[plot]' "
                          "(or pip install matplotlib)") from None
    return plt


def save_plot(path: str, traces: dict[str, StepTrace], group_bytes: dict[str, dict[str, int]], title: str,
              memory_label: str, relative: bool = False, note: str | None = None,
              held_back: dict[str, str] | None = None) -> None:
    """Top: allocated memory over one profiled step per configuration, with forward and
    backward marked (``relative``: memory counted from each step's start, for counters
    that do not start at zero; ``note``: a caveat printed on the panel). Bottom: bytes
    offloaded per group for each offloading configuration; ``held_back`` labels the
    groups that moved nothing on purpose (group -> why, e.g. kept by ``keep_last``).

    Example::

        save_plot("demo.png", {"none": trace_a, "fast": trace_b}, {"fast": {"0": 2**28, "1": 0}},
                  "H100, GPT d=1024", "GPU memory allocated (GiB)", held_back={"1": "kept (keep_last=1)"})
    """
    plt = require_matplotlib()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, trace) in enumerate(traces.items()):
        color = colors[i % len(colors)]
        if trace.memory:
            xs, ys = zip(*trace.memory)
            origin = ys[0] if relative else 0
            top.step(xs, [(y - origin) / 2**30 for y in ys], where="post", color=color, lw=1.4, label=name)
        top.axvline(trace.backward_ms[0], color=color, ls="--", lw=0.8)  # this configuration's backward starts
    top.set_xlabel("ms since the step's forward began (dashed: where each configuration's backward began)")
    top.set_ylabel(memory_label)
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=8)
    if note:
        top.text(0.01, 0.98, note, transform=top.transAxes, va="top", ha="left", fontsize=7.5,
                 bbox=dict(boxstyle="round", facecolor="lightyellow", edgecolor="0.6", alpha=0.9))

    names = [n for n, g in group_bytes.items() if g]
    groups = sorted({g for n in names for g in group_bytes[n]}, key=_natural)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        at = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
        color = colors[list(traces).index(name) % len(colors)] if name in traces else colors[i % len(colors)]
        bottom.bar(at, [group_bytes[name].get(g, 0) / MiB for g in groups], width, label=name, color=color)
    for j, g in enumerate(groups):
        if held_back and g in held_back:  # an empty slot would read as "offloading did nothing here"
            bottom.text(j, 0.03, held_back[g], rotation=90, ha="center", va="bottom", fontsize=8, color="0.3",
                        transform=bottom.get_xaxis_transform())  # x in data, y in axes units
    bottom.set_xticks(range(len(groups)), groups, rotation=45 if len(groups) > 12 else 0, fontsize=8)
    bottom.set_xlabel("offload group")
    bottom.set_ylabel("offloaded MiB per step")
    bottom.grid(axis="y", alpha=0.3)
    if names:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _natural(name: str):
    """'blocks.10' after 'blocks.9'."""
    return [int(p) if p.isdigit() else p for p in name.replace(".", " ").split()]
