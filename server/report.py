"""Outputs of a run: ``report.json`` and a PNG of accuracy and epsilon per round.

``report.json``::

    {"config": {...run config, kebab-case...},
     "rounds": [{"round", "n_reports", "accuracy", "loss", "eps0", "epsilon", "family", "kind", "delta",
                 "n_applied", "n_bad_reports", "epsilon_if_bad_gave_no_cover"}, ...],
     "skipped": [{"round", "reason", ...counts}], "stopped": {"round", "reason"} | null,
     "accounting": {"family", "kind": "upper", "target_delta", "epsilon", "comparison": {family: ...}},
     "finished": true once the run has ended (finished its rounds or stopped at the budget),
     "budget_changes": [{"after_round", "from", "to"}, ...]: each resume that changed budget-epsilon,
     "versions": {"shuffledp", "dp-accounting", "numpy", "scipy"}: the installed versions that wrote the report,
     ...sections the app adds: the project's own app writes "data" (what each split of the dataset did: train,
     public, test, and the seed) and, for a run planned from a target epsilon, "plan"}

``skipped`` also lists the rounds ``abandoned`` in a crash or failure before their charge (their ids were used,
nothing was released). ``rounds`` holds the charged rounds only; ``epsilon`` is cumulative, for the default family
(``family``), an upper bound (``kind``) at ``delta``. ``n_reports`` is the attested count the round was charged
with; of those, ``n_applied`` opened and decoded and ``n_bad_reports`` did not. ``epsilon`` counts every released
report as cover (the shuffle bound assumes all ``n_reports`` came from the eps0-LDP randomizer). An honest client's
report always opens, so once any round had a bad report ``epsilon_if_bad_gave_no_cover`` is the cumulative upper
bound with them taken out of each round's n (null before that); the budget stop uses the larger of the two. A round
charged but whose update was lost in a crash has ``accuracy = loss = null``, ``n_applied = 0`` and the
``n_bad_reports`` recorded when its reports were opened (0 if the crash came before).
Both files are written with ``shuffledp.shuffler.journal.write_file_durably`` (temporary file, fsync, rename, directory
fsync).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shuffledp.accounting import KIND_WORDS, format_bound
from shuffledp.accounting.versions import library_versions
from shuffledp.shuffler.journal import write_file_durably

__all__ = [
    "bad_reports_note", "epsilon_label", "format_epsilon", "report_document", "write_report", "write_plot",
    "REPORT_FILE", "PLOT_FILE",
]

REPORT_FILE = "report.json"
PLOT_FILE = "accuracy_epsilon.png"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else None)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def format_epsilon(value: float, kind: str, decimals: int = 4) -> str:
    """``value`` with ``decimals`` decimals, rounded *outward* for a bound (:func:`accounting.format_bound`): a
    printed upper bound is never below the bound (report.json and the ledger keep the exact value)."""
    return format_bound(value, kind, decimals=decimals)


def bad_reports_note(n_bad: int, epsilon_no_cover: float | None, kind: str) -> str:
    """The tail of a round's progress line: how many reports failed to open or decode, and the cumulative bound if
    they gave no cover (``epsilon_if_bad_gave_no_cover``, rounded outward as every printed bound); empty for a run
    without bad reports."""
    text = f", {n_bad} bad reports skipped" if n_bad else ""
    if epsilon_no_cover is not None:
        text += f", epsilon {format_epsilon(epsilon_no_cover, kind)} if the bad reports gave no cover"
    return text


def epsilon_label(family: str, kind: str) -> str:
    """``"clones, upper bound"``: what a printed epsilon is (a missing family or kind is shown as ``n/a``)."""
    return f"{family or 'family n/a'}, {KIND_WORDS.get(kind, kind or 'kind n/a')}"


def report_document(
    *,
    config: Mapping[str, Any],
    rounds: Sequence[Mapping[str, Any]],
    skipped: Sequence[Mapping[str, Any]] = (),
    stopped: Mapping[str, Any] | None = None,
    accounting: Mapping[str, Any] | None = None,
    finished: bool = False,
    budget_changes: Sequence[Mapping[str, Any]] = (),
    versions: Mapping[str, str] | None = None,
    sections: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the ``report.json`` document.

    Floats may be infinite here; :func:`write_report` writes them as the strings ``"inf"``/``"-inf"``.

    Args:
        config: the run's configuration (kebab-case keys).
        rounds: the charged rounds, oldest first.
        skipped: the rounds skipped or abandoned (nothing released, nothing charged).
        stopped: ``{"round", "reason"}`` of a stop at the budget, or None.
        accounting: the accounting summary (family, kind, target delta, epsilon, comparison), or None.
        finished: the run has ended normally.
        budget_changes: each resume that changed budget-epsilon.
        versions: distribution -> version of shuffledp and the accounting libraries; None reads the installed
            ones (:func:`shuffledp.accounting.versions.library_versions`).
        sections: more top-level sections from the app (e.g. ``"data"``); a name the document already has is
            refused with ValueError.

    Returns:
        The document, with the keys listed in the module docstring.
    """
    document = {
        "finished": bool(finished),
        "config": dict(config),
        "rounds": [dict(r) for r in rounds],
        "skipped": [dict(s) for s in skipped],
        "stopped": None if stopped is None else dict(stopped),
        "accounting": None if accounting is None else dict(accounting),
        "budget_changes": [dict(c) for c in budget_changes],
        "versions": library_versions() if versions is None else dict(versions),
    }
    for name, value in (sections or {}).items():
        if name in document:
            raise ValueError(f"report section {name!r} would replace the report's own {name!r}")
        document[name] = value
    return document


def write_report(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write a :func:`report_document` to ``path`` atomically and durably; return the path."""
    target = Path(path)
    text = json.dumps(_json_safe(document), indent=2, allow_nan=False) + "\n"
    write_file_durably(target, text.encode("utf-8"))
    return target


def write_plot(path: str | os.PathLike[str], rounds: Sequence[Mapping[str, Any]], *, title: str = "") -> Path:
    """Plot test accuracy and cumulative epsilon (upper bound) per charged round into a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    xs = [int(r["round"]) for r in rounds]
    acc = [float("nan") if r.get("accuracy") is None else float(r["accuracy"]) for r in rounds]
    eps = [float("nan") if r.get("epsilon") is None else float(r["epsilon"]) for r in rounds]
    fig, ax1 = plt.subplots(figsize=(7, 4), dpi=110)
    ax1.plot(xs, acc, marker="o", color="tab:blue", label="test accuracy")
    ax1.set_xlabel("round")
    from matplotlib.ticker import MaxNLocator

    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_ylabel("test accuracy", color="tab:blue")
    ax1.set_ylim(0.0, 1.0)
    ax1.grid(alpha=0.3)
    ax2 = ax1.twinx()
    ax2.plot(xs, eps, marker="s", color="tab:red", label="cumulative epsilon (upper bound)")
    ax2.set_ylabel("cumulative epsilon (upper bound)", color="tab:red")
    ax2.set_ylim(bottom=0.0)
    if title:
        ax1.set_title(title, fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    return write_file_durably(path, png.getvalue())
