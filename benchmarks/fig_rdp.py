"""Figures 2 and 3 of Chen, Cao, Ge, "Renyi DP in the shuffle model: enhanced amplification bounds", ICASSP 2024
(seed 000), redone with every curve labelled by what it is.

Fig. 2: Renyi DP of one shuffled round against eps0, at order lambda = 4 and n = 1e4.
Fig. 3: Renyi DP of one shuffled round against lambda, at eps0 = 2 and n = 1e4.

Curves: ccg-rdp (seed 000 Cor. 2, approximate), girgis (seed 000 eq. (5), upper), girgis-lower (eq. (6), lower),
clones-focs (FOCS'21 clone pair, exact divergence of the pair: upper), clones (stronger clone pair: upper),
rr-lower (exact divergence of shuffled binary randomized response: lower). Values come from
:func:`shuffledp.accounting.bounds.renyi`. The script prints the table behind each figure, then writes
``fig2_rdp_vs_eps0.png`` and ``fig3_rdp_vs_order.png`` into the output directory.

Usage: python benchmarks/fig_rdp.py [OUT_DIR]   (default: benchmarks/out/ next to this script)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from shuffledp.accounting import RefusedError, bounds

N = 10_000
FIG2_ORDER = 4
FIG2_EPS0 = tuple(np.round(np.linspace(0.1, 5.0, 50), 4))
FIG3_EPS0 = 2.0
FIG3_ORDERS = tuple(range(2, 41))

CURVES = (
    ("ccg-rdp", "ccg-rdp (Cor. 2, approximate)", "tab:orange", "--"),
    ("girgis", "Girgis et al. upper (eq. 5)", "tab:red", "-"),
    ("girgis-lower", "Girgis et al. lower (eq. 6)", "tab:pink", ":"),
    ("clones-focs", "clones-focs (exact, FOCS'21 pair: upper)", "tab:blue", "-."),
    ("clones", "clones (exact, stronger pair: upper)", "tab:green", "-"),
    ("rr-lower", "rr-lower (exact binary RR: lower)", "black", ":"),
)


def curve(family: str, xs: tuple, *, vary: str) -> np.ndarray:
    """Renyi values of ``family`` along ``xs`` (NaN where the family refuses)."""
    out = []
    for x in xs:
        eps0, order = (float(x), FIG2_ORDER) if vary == "eps0" else (FIG3_EPS0, int(x))
        try:
            out.append(bounds.renyi(family, eps0, N, order).value)
        except RefusedError:
            out.append(float("nan"))
    return np.array(out)


def table(title: str, xname: str, xs: tuple, values: dict[str, np.ndarray], every: int) -> None:
    print(f"\n{title}")
    names = [c[0] for c in CURVES]
    print(f"{xname:>8} " + " ".join(f"{n:>13}" for n in names))
    for i in range(0, len(xs), every):
        print(f"{xs[i]:>8g} " + " ".join(f"{values[n][i]:>13.5e}" for n in names))
    below = [x for i, x in enumerate(xs) if values["ccg-rdp"][i] < values["rr-lower"][i]]
    if below:
        print(f"ccg-rdp (approximate) is BELOW the exact lower curve rr-lower at {xname} = {below}")
    above = [x for i, x in enumerate(xs) if values["clones"][i] > values["girgis"][i]]
    print(f"clones above girgis at {xname} = {above if above else 'none'}")


def plot(path: Path, xs: tuple, values: dict[str, np.ndarray], xlabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    for family, label, colour, style in CURVES:
        ax.plot(xs, values[family], style, color=colour, label=label, linewidth=1.6)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Renyi divergence of one shuffled round")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    fig2 = {family: curve(family, FIG2_EPS0, vary="eps0") for family, *_ in CURVES}
    t1 = time.perf_counter()
    fig3 = {family: curve(family, FIG3_ORDERS, vary="order") for family, *_ in CURVES}
    t2 = time.perf_counter()

    table(f"Fig. 2: RDP vs eps0 (lambda = {FIG2_ORDER}, n = {N})", "eps0", FIG2_EPS0, fig2, every=7)
    table(f"Fig. 3: RDP vs lambda (eps0 = {FIG3_EPS0}, n = {N})", "lambda", FIG3_ORDERS, fig3, every=4)
    print(f"\ncompute time: fig. 2 {t1 - t0:.2f} s ({len(FIG2_EPS0)} points x {len(CURVES)} curves), "
          f"fig. 3 {t2 - t1:.2f} s ({len(FIG3_ORDERS)} points x {len(CURVES)} curves)")

    p2, p3 = out / "fig2_rdp_vs_eps0.png", out / "fig3_rdp_vs_order.png"
    plot(p2, FIG2_EPS0, fig2, "eps0", f"RDP at lambda = {FIG2_ORDER}, n = {N}")
    plot(p3, FIG3_ORDERS, fig3, "Renyi order lambda", f"RDP at eps0 = {FIG3_EPS0}, n = {N}")
    print(f"wrote {p2}\nwrote {p3}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
