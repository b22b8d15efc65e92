"""`pdserve plan --plot FILE.png`: goodput per worker and latency against the P:D split (at the
planned rate, each split with its best settings), and, with `--rates`, against the rate (a
line per split). matplotlib is imported here only, lazily (the `plan` extra)."""
from __future__ import annotations


def _best_per_split(ranked) -> list:
    seen, out = set(), []
    for c in ranked:
        if (c.prefill, c.decode) not in seen:
            seen.add((c.prefill, c.decode))
            out.append(c)
    return sorted(out, key=lambda c: (c.workers, c.prefill))


def plot(path: str, ranked, sweep_rows: list[dict], rate: float, attainment: float) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("pdserve plan --plot needs matplotlib: pip install matplotlib "
                         "(or pip install 'pdserve[plan]')") from None
    rows = 2 if sweep_rows else 1
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4.2 * rows), squeeze=False)
    splits = _best_per_split(ranked)
    names = [c.name.replace(" colocated", "C") for c in splits]
    x = range(len(splits))
    colours = ["tab:green" if c.meets(attainment) else "tab:gray" for c in splits]
    top = axes[0]
    top[0].bar(x, [c.goodput_per_worker for c in splits], color=colours)
    top[0].set_title(f"goodput per worker at {rate:.3g} req/s (grey: misses target)")
    top[0].set_ylabel("req/s per worker")
    for ax, key, label in ((top[1], "ttft", "TTFT ms"), (top[2], "itl", "ITL ms")):
        ax.bar([i - 0.2 for i in x], [c.summary.get(f"{key}_p50_ms") or 0 for c in splits],
               0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [c.summary.get(f"{key}_p90_ms") or 0 for c in splits],
               0.4, label="p90")
        ax.set_title(f"{label} by P:D split")
        ax.legend()
    for ax in top:
        ax.set_xticks(list(x), names, rotation=45)
        ax.set_xlabel("P:D split (NC: N colocated workers)")
    if sweep_rows:
        _rate_panels(axes[1], sweep_rows)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)


def _rate_panels(axes, rows: list[dict]) -> None:
    lines: dict[str, list[dict]] = {}
    for r in rows:
        name = f"{r['decode']}C" if r["prefill"] == 0 else f"{r['prefill']}P{r['decode']}D"
        lines.setdefault(name, []).append(r)
    panels = ((axes[0], lambda r: r["goodput_per_worker"], "goodput per worker (req/s)"),
              (axes[1], lambda r: r["predicted"]["ttft_p90_ms"], "TTFT p90 ms"),
              (axes[2], lambda r: r["predicted"]["itl_p50_ms"], "ITL p50 ms"))
    for ax, value, label in panels:
        for name, pts in lines.items():
            pts = sorted(pts, key=lambda r: r["rate"])
            ax.plot([p["rate"] for p in pts], [value(p) or 0 for p in pts], marker="o",
                    label=name)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(f"{label} against the rate")
    axes[0].legend(fontsize="small", ncol=2)
