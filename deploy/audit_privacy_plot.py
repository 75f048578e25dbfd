"""Figures of ``shuffledp audit privacy``: the audit's empirical lower bound beside the accountant's upper bound
(``clones``), ``rr-lower`` and any mechanism-aware family, against eps0 and against n (one panel per T)."""

from __future__ import annotations

from pathlib import Path

from shuffledp.deploy.audit_privacy import AuditResult

__all__ = ["plot_results"]

_FLOOR = 0.01  # where a lower bound of 0 is drawn on the log axis

_STYLE = {
    "clones": {"color": "C0", "linestyle": "-", "label": "clones (upper, generic)"},
    "rr-lower": {"color": "C1", "linestyle": "--", "label": "rr-lower (lower, generic accounting)"},
    "blanket-laplace": {"color": "C2", "linestyle": "-.", "label": "blanket-laplace (upper, mechanism-aware)"},
}


def _panel(ax: object, results: list[AuditResult], x: str) -> None:
    rows = sorted(results, key=lambda r: getattr(r, x))
    xs = [getattr(r, x) for r in rows]
    for fam, style in _STYLE.items():
        ys = [r.references.get(fam, {}).get("value") for r in rows]
        pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
        if pts:
            ax.plot(*zip(*pts), marker=".", **style)  # type: ignore[attr-defined] - a matplotlib Axes
    fit = [(a, r.gaussian_fit) for a, r in zip(xs, rows) if r.gaussian_fit is not None]
    if fit:
        ax.plot(*zip(*fit), color="0.5", linestyle=":", marker="x",  # type: ignore[attr-defined] - an Axes
                label="Gaussian fit of the audited instance (estimate)")
    pos = [(a, r.epsilon_lower) for a, r in zip(xs, rows) if r.epsilon_lower > 0]
    zero = [(a, _FLOOR) for a, r in zip(xs, rows) if r.epsilon_lower <= 0]
    if pos:
        ax.plot(*zip(*pos), color="C3", marker="o", linestyle="none",  # type: ignore[attr-defined] - an Axes
                label="audit lower bound (empirical, Clopper-Pearson)")
    if zero:
        ax.plot(*zip(*zero), color="C3", marker="o", markerfacecolor="none",  # type: ignore[attr-defined] - an Axes
                linestyle="none", label=f"audit lower bound 0 (drawn at {_FLOOR:g})")


def plot_results(results: list[AuditResult], prefix: str | Path) -> list[Path]:
    """Draw the results against eps0 (one line per n) and against n (one line per eps0), one panel per T.

    Args:
        results: audits of one pipeline on a grid of (eps0, n, T).
        prefix: output path prefix; writes ``{prefix}_vs_eps0.png`` and ``{prefix}_vs_n.png`` where the grid has
            two or more values of that axis.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rounds = sorted({r.rounds for r in results})
    for x, other in (("eps0", "n"), ("n", "eps0")):
        if len({getattr(r, x) for r in results}) < 2:
            continue
        groups = sorted({getattr(r, other) for r in results})
        fig, axes = plt.subplots(len(groups), len(rounds), figsize=(5.2 * len(rounds), 3.6 * len(groups)),
                                 squeeze=False)
        for i, g in enumerate(groups):
            for j, t in enumerate(rounds):
                ax = axes[i][j]
                sel = [r for r in results if getattr(r, other) == g and r.rounds == t]
                _panel(ax, sel, x)
                ax.set_title(f"{other} = {g:g}, T = {t}", fontsize=10)
                ax.set_xlabel("eps0" if x == "eps0" else "n (reports per round)")
                ax.set_ylabel(f"epsilon at delta = {results[0].delta:g}")
                if x == "n":
                    ax.set_xscale("log")
                ax.set_yscale("log")
                ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7, loc="best")
        r0 = results[0]
        lo, hi = min(r.trials for r in results), max(r.trials for r in results)
        trials = f"{lo}" if lo == hi else f"{lo} to {hi}"
        fig.suptitle(f"{r0.pipeline}: empirical audit vs accounting (others: {r0.others}; {trials} trials per "
                     f"hypothesis, confidence {r0.confidence:g})", fontsize=10)
        fig.tight_layout()
        path = Path(f"{prefix}_vs_{x}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
