"""The guides' comparison as a PNG: TTFT and throughput change against no connector."""

from __future__ import annotations


def draw(rows: list[dict], records: list[dict], name: str, title: str):
    from _common import pyplot, save_figure

    plt = pyplot()
    if plt is None or not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "TTFT mean ms", "TTFT mean (ms)"), (axes[1], "total tok/s", "total tokens/s")):
        cells = [r for r in rows]
        xs = [f"{r['scenario']}\n{r['config']}" for r in cells]
        ax.bar(range(len(cells)), [r[key] for r in cells], color=["#999" if r["config"] == "none" else "#3a7" for r in cells])
        # every repeat as a dot: the spread is part of the figure
        for i, r in enumerate(cells):
            vals = [rec["figures"]["ttft_mean"] * 1e3 if key.startswith("TTFT") else rec["figures"]["total_tps"]
                    for rec in records if (rec["scenario"], rec["config"]) == (r["scenario"], r["config"])
                    and rec.get("engine") == r["engine"]]
            ax.plot([i] * len(vals), vals, "k.", ms=4)
            pct = r.get("TTFT mean vs none %" if key.startswith("TTFT") else "total tok/s vs none %")
            if pct is not None and pct == pct:
                ax.annotate(f"{pct:+.0f}%", (i, r[key]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(cells)), xs, fontsize=7)
        ax.set_ylabel(label)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, name)
