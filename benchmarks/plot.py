"""Draw a benchmark's JSON (from bench.py) as PNG files next to it.

    python benchmarks/plot.py benchmarks/results/latest.json

bench.py calls this itself when matplotlib is installed (`pip install -e '.[bench]'`).
Two pictures:

- ``<stem>-latency.png``: time per operation against N, one line per backend, a
  panel per small-object workload (the slowest rank's median);
- ``<stem>-throughput.png``: GB/s of the array workloads against their size,
  a panel per N, a line per backend (and a line style per kind of array).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

SIZE = re.compile(r"(\d+) (KiB|MiB|GiB)$")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _workloads(results: dict[str, Any]) -> tuple[list[str], dict[str, list[tuple[int, str]]]]:
    """Small-object workloads (timed per op), and array workloads by kind: [(bytes, name)]."""
    names: list[str] = []
    for by_n in results.values():
        for per in by_n.values():
            names += [w for w, v in per.items() if isinstance(v, dict) and w not in names]
    small = [w for w in names if "median_s" in _any(results, w) and not SIZE.search(w)
             and "ops_per_s" not in _any(results, w)]
    arrays: dict[str, list[tuple[int, str]]] = {}
    for w in names:
        m = SIZE.search(w)
        if m:
            arrays.setdefault(w[:m.start()].strip(), []).append((int(m[1]) * UNITS[m[2]], w))
    return small, {k: sorted(v) for k, v in arrays.items()}


def _any(results: dict[str, Any], workload: str) -> dict[str, Any]:
    for by_n in results.values():
        for per in by_n.values():
            if isinstance(per.get(workload), dict):
                return per[workload]  # type: ignore[no-any-return]
    return {}


def draw(path: str) -> list[str]:
    """Write the PNGs for the JSON at ``path``; return their paths ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    with open(path) as f:
        data = json.load(f)
    results: dict[str, dict[str, dict[str, Any]]] = data["results"]
    small, arrays = _workloads(results)
    stem = os.path.splitext(path)[0]
    written = []
    title = f"{data.get('date', '')}, {data.get('cpus', '?')} cores, {data.get('rounds', '?')} rounds"

    if small:
        fig, axes = plt.subplots(1, len(small), figsize=(4.2 * len(small), 3.6), squeeze=False)
        for ax, workload in zip(axes[0], small, strict=True):
            for backend, by_n in results.items():
                points = sorted((int(n), per[workload]["median_s"] * 1e6) for n, per in by_n.items()
                                if isinstance(per.get(workload), dict))
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=backend)
            ax.set_title(workload, fontsize=9)
            ax.set_xlabel("replicas (N)")
            ax.set_ylabel("µs per operation (log)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"time per operation, slowest rank's median ({title})", fontsize=10)
        fig.tight_layout()
        written.append(f"{stem}-latency.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    if arrays:
        ns = sorted({int(n) for by_n in results.values() for n in by_n})
        styles = ["-", "--", ":", "-."]
        fig, axes = plt.subplots(1, len(ns), figsize=(4.6 * len(ns), 3.8), squeeze=False, sharey=True)
        for ax, n in zip(axes[0], ns, strict=True):
            for color, (backend, by_n) in enumerate(results.items()):
                per = by_n.get(str(n), {})
                for style, (kind, sized) in zip(styles, sorted(arrays.items()), strict=False):
                    points = [(size / (1 << 20), per[w]["gb_per_s"]) for size, w in sized
                              if isinstance(per.get(w), dict) and "gb_per_s" in per[w]]
                    if points:
                        ax.plot(*zip(*points, strict=True), marker="o", linestyle=style, color=f"C{color}",
                                label=f"{backend}, {kind}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"N = {n}", fontsize=9)
            ax.set_xlabel("array size (MiB)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("GB/s (one rank's data / time)")
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(f"array throughput ({title})", fontsize=10)
        fig.tight_layout()
        written.append(f"{stem}-throughput.png")
        fig.savefig(written[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return written


def main() -> None:
    for path in sys.argv[1:] or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                               "latest.json")]:
        written = draw(path)
        if not written:
            print("matplotlib is not installed: pip install -e '.[bench]'", file=sys.stderr)
        for png in written:
            print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
