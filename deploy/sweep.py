"""``shuffledp sweep``: a grid of in-process runs (:mod:`shuffledp.deploy.inprocess`, the apps' own report path)
over mechanisms, eps0 or target epsilon, rounds and seeds, written as ONE table and ONE figure.

Each row of the table is a group (mechanism, eps0 or target epsilon, rounds); the searched settings (server
learning rates, clips) are chosen within the group on the mean PUBLIC accuracy after the last round over the
seeds, and the row reports that setting's TEST accuracy (mean, min, max over the same seeds), which takes no part
in the choice (:func:`shuffledp.deploy.inprocess_study.choose`). The epsilon is the accounting family's cumulative
epsilon of the rounds run at n = the number of clients (planned from the target when one is given).

Files written into ``--out``: ``sweep.csv`` (the table), ``sweep.md`` (the same table in markdown) and
``sweep.png`` (test accuracy against epsilon, one line per mechanism and round count, min-max over seeds).

Example::

    shuffledp sweep --mechanisms laplace,duchi --target-epsilon 1,2,4 --rounds 10 --seeds 3 \\
        --dataset digits --server-lr 2,5 --out sweep-out

Exit code 0 after writing the files; 2 for bad arguments (the reason, naming what is allowed, on stderr).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shuffledp.deploy.audit_privacy_cli import parse_list
from shuffledp.deploy.inprocess_study import Choice, Outcome, choose, grid_trials, run_trials

__all__ = ["main", "parse_args", "rows", "write_table", "markdown", "plot", "COLUMNS"]

#: The table's columns, in order.
COLUMNS = ("mechanism", "budget", "budget_value", "rounds", "eps0", "epsilon", "kind", "family", "server_lr", "clip",
           "public", "test_mean", "test_min", "test_max", "seeds", "seconds")
_PCA = {"digits": 10, "mnist5k": 20, "mnist5k-aug": 20, "mnist": 60}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shuffledp sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--mechanisms", default="laplace,duchi,privunit2",
                   help="comma-separated, of laplace, duchi, privunit2 (default: all three)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--eps0", help="local epsilons, comma-separated")
    budget.add_argument("--target-epsilon", help="target epsilons, comma-separated (eps0 planned per rounds)")
    p.add_argument("--rounds", default="10", help="round counts, comma-separated (default: 10)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 per setting: data split, partition, initial "
                   "model; never noise (default: 1)")
    p.add_argument("--dataset", default="digits", help="digits, mnist5k, mnist5k-aug or mnist (default: digits)")
    p.add_argument("--data-dir", default=None, help="the MNIST folder (dataset mnist)")
    p.add_argument("--num-clients", type=int, default=None, help="clients (default: one per training row)")
    p.add_argument("--pca", type=int, default=None, help="PCA components fitted on the public split (0: none; "
                   "default: 10 digits, 20 mnist5k and mnist5k-aug, 60 mnist)")
    p.add_argument("--server-lr", default="5", help="server SGD learning rates, comma-separated; chosen per row on "
                   "public accuracy (default: 5)")
    p.add_argument("--clip", default="1", help="clips (L1 for laplace, L2 otherwise), comma-separated; chosen per "
                   "row on public accuracy (default: 1)")
    p.add_argument("--family", default="auto",
                   help="accounting family (default: auto, the apps' rigorous default for each mechanism)")
    p.add_argument("--delta", type=float, default=1e-6, help="target delta (default: 1e-6)")
    p.add_argument("--chunk", type=int, default=10_000, help="clients per batch of reports (default: 10000)")
    p.add_argument("--workers", type=int, default=1,
                   help="threads per run that randomize and decode chunks of reports (default: 1)")
    p.add_argument("--through-shuffler", action="store_true",
                   help="send every round's sealed reports through a real shuffler process (slow; small n)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default: 1)")
    p.add_argument("--out", required=True, type=Path, help="directory for sweep.csv, sweep.md, sweep.png")
    return p


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse and check the arguments.

    Returns:
        ``(namespace, grid)``: the grid has ``mechanisms``, ``budget`` (``"eps0"`` or ``"target_epsilon"``),
        ``values``, ``rounds``, ``server_lr``, ``clip`` and ``pca``.

    Raises:
        SystemExit: bad arguments (argparse's exit 2); ValueError: a value out of range (the message says what is
            allowed).
    """
    from shuffledp.accounting import FAMILIES
    from shuffledp.accounting.families import AUTO_FAMILY, FAMILY_MECHANISMS
    from shuffledp.clients.data import DATASETS
    from shuffledp.clients.mechanism import check_mechanism_name

    ns = _parser().parse_args(list(argv))
    mechanisms = [check_mechanism_name(m.strip(), "--mechanisms") for m in ns.mechanisms.split(",") if m.strip()]
    if not mechanisms:
        raise ValueError("--mechanisms is empty; allowed: laplace, duchi, privunit2")
    budget = "eps0" if ns.eps0 is not None else "target_epsilon"
    flag = "--eps0" if budget == "eps0" else "--target-epsilon"
    values = parse_list(ns.eps0 if budget == "eps0" else ns.target_epsilon, float, flag)
    if not all(0 < v <= 64 and math.isfinite(v) for v in values):
        raise ValueError(f"{flag} values must be in (0, 64], got {values}")
    rounds = parse_list(ns.rounds, int, "--rounds")
    if not all(r >= 1 for r in rounds):
        raise ValueError(f"--rounds values must be ints >= 1, got {rounds}")
    lrs = parse_list(ns.server_lr, float, "--server-lr")
    clips = parse_list(ns.clip, float, "--clip")
    for name, vals in (("--server-lr", lrs), ("--clip", clips)):
        if not all(v > 0 and math.isfinite(v) for v in vals):
            raise ValueError(f"{name} values must be finite and > 0, got {vals}")
    if ns.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {ns.seeds}")
    if ns.dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}; got {ns.dataset!r}")
    if ns.num_clients is not None and ns.num_clients < 2:
        raise ValueError(f"--num-clients must be >= 2, got {ns.num_clients}")
    if ns.family not in (*FAMILIES, AUTO_FAMILY):
        raise ValueError(f"--family must be {AUTO_FAMILY!r} or one of {', '.join(FAMILIES)}; got {ns.family!r}")
    needed = FAMILY_MECHANISMS.get(ns.family)
    if needed is not None and set(mechanisms) != {needed}:
        raise ValueError(f"--family {ns.family} holds only for reports of the {needed!r} mechanism; --mechanisms "
                         f"{','.join(mechanisms)} needs a generic family or 'auto' (each mechanism's own default)")
    if not 0 < ns.delta < 1:
        raise ValueError(f"--delta must be in (0, 1), got {ns.delta}")
    if min(ns.chunk, ns.jobs, ns.workers) < 1:
        raise ValueError(f"--chunk, --jobs and --workers must be >= 1, got {ns.chunk}, {ns.jobs} and {ns.workers}")
    pca = _PCA.get(ns.dataset) if ns.pca is None else (ns.pca or None)
    if pca is not None and pca < 0:
        raise ValueError(f"--pca must be >= 0, got {ns.pca}")
    grid = {"mechanisms": mechanisms, "budget": budget, "values": values, "rounds": rounds, "server_lr": lrs,
            "clip": clips, "pca": pca}
    return ns, grid


def rows(choices: Sequence[Choice], budget: str) -> list[dict[str, Any]]:
    """The table's rows (:data:`COLUMNS`) from choices whose group is ``(mechanism, budget value, rounds)``.

    Returns:
        One dict per choice.
    """
    out = []
    for c in choices:
        mech, value, rounds = c.group  # type: ignore[misc] - the sweep's groups are 3-tuples
        out.append({"mechanism": mech, "budget": budget, "budget_value": value, "rounds": rounds, "eps0": c.eps0,
                    "epsilon": c.epsilon, "kind": c.kind, "family": c.family,
                    "server_lr": c.setting.get("server_lr"), "clip": c.setting.get("clip"),
                    "public": c.public_mean, "test_mean": c.test_mean, "test_min": min(c.test),
                    "test_max": max(c.test), "seeds": len(c.test), "seconds": c.seconds})
    return out


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown(table: Sequence[dict[str, Any]], title: str) -> str:
    """The rows as a markdown table under ``title``.

    Returns:
        The text.
    """
    lines = [title, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in table]
    return "\n".join(lines) + "\n"


def write_table(table: Sequence[dict[str, Any]], out: Path, title: str) -> tuple[Path, Path]:
    """Write ``sweep.csv`` and ``sweep.md`` into ``out``.

    Returns:
        The two paths.
    """
    out.mkdir(parents=True, exist_ok=True)
    path_csv, path_md = out / "sweep.csv", out / "sweep.md"
    with path_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(table)
    path_md.write_text(markdown(table, title))
    return path_csv, path_md


def plot(table: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Test accuracy against epsilon, one line per (mechanism, rounds), error bars min-max over the seeds.

    Returns:
        ``path`` (a PNG).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    series = dict.fromkeys((r["mechanism"], r["rounds"]) for r in table)
    several = len({r["rounds"] for r in table}) > 1
    for mech, rounds in series:
        pts = sorted((r for r in table if (r["mechanism"], r["rounds"]) == (mech, rounds)), key=lambda r: r["epsilon"])
        means = [r["test_mean"] for r in pts]
        low = [m - r["test_min"] for m, r in zip(means, pts)]
        high = [r["test_max"] - m for m, r in zip(means, pts)]
        ax.errorbar([r["epsilon"] for r in pts], means, yerr=[low, high], marker="o", capsize=3,
                    label=f"{mech}, T={rounds}" if several else mech)
    ax.set_xscale("log", base=2)
    fam = table[0]["family"] if table else ""
    ax.set_xlabel(f"epsilon ({fam}, cumulative over the rounds)")
    ax.set_ylabel("test accuracy (mean, min-max over seeds)")
    ax.set_title(textwrap.fill(title, 100), fontsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _check_plans(ns: argparse.Namespace, grid: dict[str, Any]) -> None:
    """Plan every (target epsilon, rounds) before the runs (a target no eps0 meets is a bad argument)."""
    from shuffledp.accounting import RefusedError
    from shuffledp.accounting.families import resolve_family
    from shuffledp.deploy.inprocess import build_setup, plan_and_account

    n = ns.num_clients or build_setup(ns.dataset, pca_components=grid["pca"], data_dir=ns.data_dir).num_clients
    for mech in grid["mechanisms"]:
        family = resolve_family(ns.family, mech)
        for value in grid["values"]:
            for rounds in grid["rounds"]:
                try:
                    plan_and_account(None, value, n=n, rounds=rounds, delta=ns.delta, family=family)
                except RefusedError as exc:
                    raise ValueError(f"--target-epsilon {value:g} cannot be met in {rounds} rounds of {n} reports "
                                     f"({mech}, {family}): {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``shuffledp sweep ...`` (``argv`` may start with ``"sweep"``). See the module docstring.

    Returns:
        The exit code.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "sweep":
        args = args[1:]
    try:
        ns, grid = parse_args(args)
        if grid["budget"] == "target_epsilon":
            _check_plans(ns, grid)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"shuffledp sweep: error: {exc}\n")
        return 2
    fixed = {"dataset": ns.dataset, "pca_components": grid["pca"], "num_clients": ns.num_clients,
             "data_dir": ns.data_dir, "delta": ns.delta, "family": ns.family, "chunk": ns.chunk,
             "workers": ns.workers, "through_shuffler": ns.through_shuffler}
    groups = {"mechanism": grid["mechanisms"], grid["budget"]: grid["values"], "rounds": grid["rounds"]}
    trials = grid_trials(groups, {"server_lr": grid["server_lr"], "clip": grid["clip"]}, range(ns.seeds), fixed)
    t0 = time.perf_counter()
    done = [0]

    def progress(o: Outcome) -> None:
        done[0] += 1
        mech, value, rounds = o.trial.group  # type: ignore[misc] - the sweep's groups are 3-tuples
        setting = " ".join(f"{k}={v:g}" for k, v in o.trial.setting)
        print(f"[{done[0]}/{len(trials)}] {mech} {grid['budget']}={value:g} rounds={rounds} seed={o.trial.seed} "
              f"{setting}: public {o.public:.3f}, test {o.test:.3f}, eps0 {o.eps0:.4g}, epsilon {o.epsilon:.4g} "
              f"({o.kind}, {o.family}), {o.seconds:.1f} s", flush=True)

    outcomes = run_trials(trials, jobs=ns.jobs, progress=progress)
    table = rows(choose(outcomes), grid["budget"])
    clients = f"{ns.num_clients} clients" if ns.num_clients else "one client per training row"
    title = (f"shuffledp sweep: {ns.dataset}, {clients}, PCA {grid['pca']}, logreg; epsilon "
             f"= {ns.family} at delta={ns.delta:g}; setting chosen on PUBLIC accuracy, TEST accuracy over "
             f"{ns.seeds} seed(s)")
    paths = [*write_table(table, ns.out, title), plot(table, ns.out / "sweep.png", title)]
    print()
    print(markdown(table, title), end="")
    print(f"({len(trials)} runs, {time.perf_counter() - t0:.0f} s); wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
