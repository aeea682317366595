"""`--plot FILE.png` for the offline benchmarks: the step-time breakdown as bars and, for a sweep
of batch sizes, measured throughput against the bound. matplotlib is optional (the `bench`
extra) and imported only here, only when a plot is asked for."""

from __future__ import annotations

from typing import Any

from attnserve.bench.breakdown import CATEGORIES, Breakdown

INSTALL_HINT = "--plot needs matplotlib: pip install 'attnserve[bench]' (or matplotlib)"


def require_matplotlib() -> Any:
    """matplotlib's pyplot on a file-only backend; ValueError when it is not installed."""
    try:
        import matplotlib
    except ImportError as error:
        raise ValueError(INSTALL_HINT) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(
    path: str, title: str, breakdown: Breakdown | None, sweep: list[dict[str, float]]
) -> None:
    """One panel per figure there is: the breakdown, the sweep."""
    plt = require_matplotlib()
    panels = int(breakdown is not None) + int(bool(sweep))
    if not panels:
        raise ValueError("nothing to plot: use --profile-steps > 0 or --batch-sizes")
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    column = iter(axes[0])
    if breakdown is not None:
        _breakdown_panel(next(column), breakdown)
    if sweep:
        _sweep_panel(next(column), sweep)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _breakdown_panel(ax: Any, breakdown: Breakdown) -> None:
    values = [breakdown.ms[c] for c in CATEGORIES]
    bars = ax.bar(CATEGORIES, values, color=["C0", "C1", "C4", "C2", "C7", "C3"])
    ax.bar_label(bars, labels=[f"{breakdown.share(c):.0%}" for c in CATEGORIES])
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"step time ({breakdown.source})")


def _sweep_panel(ax: Any, sweep: list[dict[str, float]]) -> None:
    sizes = [row["batch_size"] for row in sweep]
    ax.plot(sizes, [row["output_tokens_per_s"] for row in sweep], "o-", label="measured")
    ax.plot(sizes, [row["bound_tokens_per_s"] for row in sweep], "s--", label="bound")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(int(s)) for s in sizes])
    ax.set_xlabel("requests (all submitted at once)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput against the bound")
    ax.legend()
