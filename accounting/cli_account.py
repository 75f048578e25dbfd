"""``shuffledp account ...``: epsilon, delta, Renyi divergence, calibration, comparison and plots of the bounds.

:func:`build_parser` builds the ``account`` parser; each sub-command's handler writes its result (a table, or one
JSON object under ``--json``) and raises on invalid or refused parameters, which :func:`shuffledp.accounting.cli.main`
turns into exit 2. The numerical modules (numpy, scipy, dp_accounting) are imported by the handlers when they run,
matplotlib by ``plot`` only.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any, TextIO

from shuffledp.accounting import Bound, RefusedError, format_bound
from shuffledp.accounting.cli_common import (
    KIND_MEANING,
    Parser,
    cli_message,
    emit,
    family_names,
    finite_float,
    fmt,
    order,
    plural,
    positive_float,
    positive_int,
    probability,
    table,
)

__all__ = ["build_parser"]

#: What a calibrated eps0 means, by the kind of the family that calibrated it (the epsilon
#: meanings read backwards for an eps0: from an upper bound the eps0 is the *safe* side, from a lower bound
#: it is a limit that is not itself safe).
_CALIBRATED_MEANING = {
    "upper": "certified: an upper bound on epsilon meets the target at this eps0 (and below it)",
    "approximate": "estimate: an approximation meets the target at this eps0; not a guarantee",
    "lower": "limit, not certified: a lower bound on epsilon exceeds the target above this eps0",
}


def _finite_value(bound: Bound, what: str) -> float:
    value = float(bound.value)
    if not math.isfinite(value):
        raise ValueError(f"the {bound.family} bound gives no finite {what} for these parameters ({value!r})")
    return value


# -- commands --------------------------------------------------------------------------------------------------
def _single_result(obj: dict[str, Any], out: TextIO) -> None:
    meaning = obj.get("meaning", KIND_MEANING[obj["kind"]])
    kind = f"{obj['kind']}: {meaning}"
    # rounded outward: an upper bound never prints below itself. A calibrated eps0 from an upper bound is the safe
    # side of the largest admissible eps0, so it rounds down (and one from a lower bound, a limit, rounds up).
    direction = {"upper": "lower", "lower": "upper"}.get(obj["kind"], obj["kind"]) if obj["quantity"] == "eps0" \
        else obj["kind"]
    rows = [("quantity", obj["quantity"]), ("value", format_bound(obj["value"], direction)), ("kind", kind)]
    rows += [(k, v) for k, v in obj.items() if k not in {"quantity", "value", "kind", "meaning"}]
    table(rows, out)


def _cmd_epsilon(args: argparse.Namespace, out: TextIO) -> int:
    from shuffledp.accounting import bounds

    bound = bounds.epsilon(
        args.bound, args.eps0, args.n, args.delta, args.rounds, allow_approximate=args.allow_approximate
    )
    obj = {
        "quantity": "epsilon",
        "value": _finite_value(bound, "epsilon"),
        "kind": bound.kind,
        "bound": args.bound,
        "eps0": args.eps0,
        "n": args.n,
        "delta": args.delta,
        "rounds": args.rounds,
        **_cap_fields(bound),
        **_restriction_fields(args.bound),
    }
    return emit(obj, args.json, out, lambda: _single_result(obj, out))


def _restriction_fields(family: str) -> dict[str, Any]:
    """A mechanism-specific family's value holds only for its mechanism: say so next to the value."""
    from shuffledp.accounting.families import REGISTRY

    found = REGISTRY.get(family)
    return {"holds_only_for": found.restriction} if found is not None and found.mechanism else {}


def _cap_fields(bound: Any) -> dict[str, Any]:
    """Say when the value is the no-shuffle cap rather than the family's own value (bounds.py module docstring):
    still an upper bound, but not what the family computed (e.g. clones at a delta below its truncation mass)."""
    if not bound.details.get("capped_by_no_shuffle"):
        return {}
    uncapped = bound.details.get("uncapped")
    return {
        "capped_by_no_shuffle": True,
        "uncapped": uncapped if uncapped is None or math.isfinite(uncapped) else str(uncapped),
    }


def _cmd_delta(args: argparse.Namespace, out: TextIO) -> int:
    from shuffledp.accounting import bounds

    bound = bounds.delta(
        args.bound, args.eps0, args.n, args.epsilon, args.rounds, allow_approximate=args.allow_approximate
    )
    obj = {
        "quantity": "delta",
        "value": _finite_value(bound, "delta"),
        "kind": bound.kind,
        "bound": args.bound,
        "eps0": args.eps0,
        "n": args.n,
        "epsilon": args.epsilon,
        "rounds": args.rounds,
        **_cap_fields(bound),
        **_restriction_fields(args.bound),
    }
    return emit(obj, args.json, out, lambda: _single_result(obj, out))


def _cmd_renyi(args: argparse.Namespace, out: TextIO) -> int:
    from shuffledp.accounting import bounds

    bound = bounds.renyi(args.bound, args.eps0, args.n, args.order, args.rounds)
    obj = {
        "quantity": "renyi",
        "value": _finite_value(bound, "Renyi divergence"),
        "kind": bound.kind,
        "bound": args.bound,
        "eps0": args.eps0,
        "n": args.n,
        "order": args.order,
        "rounds": args.rounds,
    }
    return emit(obj, args.json, out, lambda: _single_result(obj, out))


def _cmd_calibrate(args: argparse.Namespace, out: TextIO) -> int:
    from shuffledp.accounting import bounds

    bound = bounds.calibrate(
        args.bound, args.target_epsilon, args.delta, args.n, args.rounds, allow_approximate=args.allow_approximate
    )
    obj = {
        "quantity": "eps0",
        "value": _finite_value(bound, "eps0"),
        "kind": bound.kind,
        "meaning": _CALIBRATED_MEANING[bound.kind],
        "bound": args.bound,
        "target_epsilon": args.target_epsilon,
        "delta": args.delta,
        "n": args.n,
        "rounds": args.rounds,
        **_calibration_fields(bound),
        **_restriction_fields(args.bound),
    }
    return emit(obj, args.json, out, lambda: _single_result(obj, out))


def _calibration_fields(bound: Any) -> dict[str, Any]:
    """What the search found besides eps0: the epsilon it achieves, the first eps0 that fails the target, and
    whether the search stopped at the top of its range (every eps0 up to it meets the target; a larger one may
    too), so a clamp at the range's end is never silent."""
    fields: dict[str, Any] = {}
    for key in ("achieved_epsilon", "first_failing_eps0", "range_upper_end_reached"):
        value = bound.details.get(key)
        if value is not None:
            fields[key] = value
    return fields


def _compare_results(args: argparse.Namespace) -> list[dict[str, Any]]:
    from shuffledp.accounting import bounds

    results: list[dict[str, Any]] = []
    for family in args.bound or family_names():
        try:
            bound = bounds.epsilon(
                family, args.eps0, args.n, args.delta, args.rounds, allow_approximate=args.allow_approximate
            )
        except RefusedError as exc:
            results.append({"bound": family, "value": None, "kind": "refused", "reason": cli_message(str(exc))})
            continue
        value = float(bound.value)
        if math.isfinite(value):
            results.append({"bound": family, "value": value, "kind": bound.kind, "reason": None, **_cap_fields(bound),
                            **_restriction_fields(family)})
        else:
            reason = f"no finite value ({value!r})"
            results.append({"bound": family, "value": None, "kind": "refused", "reason": reason})
    return results


def _cmd_compare(args: argparse.Namespace, out: TextIO) -> int:
    results = _compare_results(args)
    obj = {
        "quantity": "epsilon",
        "eps0": args.eps0,
        "n": args.n,
        "delta": args.delta,
        "rounds": args.rounds,
        "results": results,
    }

    def write_table() -> None:
        out.write(
            f"epsilon at delta={fmt(args.delta)} after {plural(args.rounds, 'round')} of n={args.n} shuffled "
            f"reports, each eps0={fmt(args.eps0)}-LDP\n\n"
        )
        rows: list[Sequence[Any]] = [("bound", "epsilon", "kind", "meaning")]
        notes: list[str] = []
        for r in results:
            if r["reason"] is None and r.get("capped_by_no_shuffle"):
                notes.append(f"[{len(notes) + 1}] {r['bound']}: this is the no-shuffle value, which caps the family's "
                             f"own ({r['uncapped']}); still an upper bound")
                meaning = f"{KIND_MEANING[r['kind']]}, capped, see [{len(notes)}]"
            elif r["reason"] is None:
                meaning = KIND_MEANING[r["kind"]]
            else:
                notes.append(f"[{len(notes) + 1}] {r['bound']}: {r['reason']}")
                meaning = f"refused, see [{len(notes)}]"
            value = r["value"] if r["value"] is None else format_bound(r["value"], r["kind"])
            rows.append((r["bound"], value, r["kind"], meaning))
        table(rows, out)
        if notes:
            out.write("\n" + "\n".join(notes) + "\n")

    return emit(obj, args.json, out, write_table)


def _cmd_plot(args: argparse.Namespace, out: TextIO) -> int:
    from shuffledp.accounting import plot  # numpy only at import; matplotlib is imported inside render_png

    families = args.bound or list(plot.DEFAULT_FAMILIES)
    if args.x == "rounds":
        if args.n is None:
            raise ValueError("plot --x rounds needs --n (the number of reports per round)")
        xs = plot.integer_grid(1, args.max_rounds, args.points)
        curves = plot.epsilon_curves(
            families, x="rounds", xs=xs, eps0=args.eps0, delta=args.delta, n=args.n,
            allow_approximate=args.allow_approximate,
        )
        title = f"eps0={fmt(args.eps0)}, n={args.n}, delta={fmt(args.delta)}"
    else:
        if args.n_max <= args.n_min:
            raise ValueError(f"plot --x n needs --n-min < --n-max, got {args.n_min} and {args.n_max}")
        xs = plot.integer_grid(args.n_min, args.n_max, args.points)
        curves = plot.epsilon_curves(
            families, x="n", xs=xs, eps0=args.eps0, delta=args.delta, rounds=args.rounds,
            allow_approximate=args.allow_approximate,
        )
        title = f"eps0={fmt(args.eps0)}, T={args.rounds}, delta={fmt(args.delta)}"
    plot.render_png(curves, x=args.x, out=args.out, title=title)
    obj = {
        "quantity": "epsilon",
        "x": args.x,
        "out": str(args.out),
        "eps0": args.eps0,
        "delta": args.delta,
        "series": [
            {
                "bound": c.family,
                "kind": c.kind,
                "points": [[x, v] for x, v in zip(c.xs, c.values)],
                "refusals": [{**r, "reason": cli_message(str(r["reason"]))} for r in c.refusals],
            }
            for c in curves
        ],
    }

    def write_table() -> None:
        out.write(f"wrote {args.out}: epsilon vs {args.x} for {plural(len(curves), 'bound')}, "
                  f"{plural(len(xs), 'point')} each\n")
        for c in curves:
            if c.refusals:
                reason = cli_message(c.refusals[0]['reason'])
                out.write(f"  {c.family}: {plural(len(c.refusals), 'point')} refused, e.g. {reason}\n")

    return emit(obj, args.json, out, write_table)


# -- parser ------------------------------------------------------------------------------------------------------
_EPS0_HELP = "local epsilon of each report (eps0-LDP randomizer), a real number > 0; required"
_N_HELP = "number of shuffled reports per round, an integer >= 1 (10000 or 1e4); required"
_DELTA_HELP = "target delta, a number strictly between 0 and 1 (e.g. 1e-6); required"
_ROUNDS_HELP = "number of rounds composed, an integer >= 1 (default: 1)"


def _add_common(p: argparse.ArgumentParser, *, allow_approximate: bool = True) -> None:
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON object instead of a table (default: off)")
    if allow_approximate:
        p.add_argument(
            "--allow-approximate",
            action="store_true",
            help="let CLT approximations (ccg-gdp, ccg-rdp, canonical-gdp) answer even where they may fall below "
            "the exact value (n/(e^eps0+1) < 2 ln(1/delta)); without it they refuse there (default: off)",
        )


def _add_bound(p: argparse.ArgumentParser, extra: Sequence[str] = ()) -> None:
    names = [*family_names(), *extra]
    p.add_argument(
        "--bound", default="clones", choices=names, metavar="NAME",
        help=f"bound family, one of: {', '.join(names)} (default: clones)",
    )


def build_parser() -> Parser:
    """Build the ``shuffledp account`` parser, each sub-command with its handler (``handler(args, out)``).

    Returns:
        The parser.
    """
    parser = Parser(prog="shuffledp account", description="Privacy accounting for the shuffle model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("epsilon", help="epsilon at a given delta after T rounds")
    p.add_argument("--eps0", type=positive_float, required=True, help=_EPS0_HELP)
    p.add_argument("--n", type=positive_int, required=True, help=_N_HELP)
    p.add_argument("--delta", type=probability, required=True, help=_DELTA_HELP)
    p.add_argument("--rounds", type=positive_int, default=1, help=_ROUNDS_HELP)
    _add_bound(p)
    _add_common(p)
    p.set_defaults(handler=_cmd_epsilon)

    p = sub.add_parser("delta", help="delta at a given epsilon after T rounds")
    p.add_argument("--eps0", type=positive_float, required=True, help=_EPS0_HELP)
    p.add_argument("--n", type=positive_int, required=True, help=_N_HELP)
    p.add_argument("--epsilon", type=finite_float, required=True,
                   help="the epsilon at which delta is stated, a finite real number; required")
    p.add_argument("--rounds", type=positive_int, default=1, help=_ROUNDS_HELP)
    _add_bound(p)
    _add_common(p)
    p.set_defaults(handler=_cmd_delta)

    p = sub.add_parser("renyi", help="Renyi divergence of a given order after T rounds")
    p.add_argument("--eps0", type=positive_float, required=True, help=_EPS0_HELP)
    p.add_argument("--n", type=positive_int, required=True, help=_N_HELP)
    p.add_argument("--order", type=order, required=True,
                   help="Renyi order alpha, a real number > 1 (clones and clones-focs: at most 10000); required")
    p.add_argument("--rounds", type=positive_int, default=1, help=_ROUNDS_HELP)
    _add_bound(p, extra=("girgis-lower",))  # Girgis et al.'s lower bound is defined for Renyi divergences
    _add_common(p, allow_approximate=False)
    p.set_defaults(handler=_cmd_renyi)

    p = sub.add_parser("calibrate", help="largest eps0 such that T rounds of n reports stay within (epsilon, delta)")
    p.add_argument("--target-epsilon", type=positive_float, required=True,
                   help="the epsilon the T rounds must stay within, a real number > 0; required")
    p.add_argument("--delta", type=probability, required=True, help=_DELTA_HELP)
    p.add_argument("--n", type=positive_int, required=True, help=_N_HELP)
    p.add_argument("--rounds", type=positive_int, required=True,
                   help="number of rounds composed, an integer >= 1; required")
    _add_bound(p)
    _add_common(p)
    p.set_defaults(handler=_cmd_calibrate)

    p = sub.add_parser("compare", help="epsilon of every bound family side by side")
    p.add_argument("--eps0", type=positive_float, required=True, help=_EPS0_HELP)
    p.add_argument("--n", type=positive_int, required=True, help=_N_HELP)
    p.add_argument("--delta", type=probability, required=True, help=_DELTA_HELP)
    p.add_argument("--rounds", type=positive_int, default=1, help=_ROUNDS_HELP)
    p.add_argument(
        "--bound", action="append", choices=family_names(), metavar="NAME",
        help=f"restrict to these families, each one of: {', '.join(family_names())} (repeatable; default: all)",
    )
    _add_common(p)
    p.set_defaults(handler=_cmd_compare)

    p = sub.add_parser("plot", help="PNG of epsilon vs rounds (or vs n) for several families")
    p.add_argument("--x", choices=("rounds", "n"), default="rounds",
                   help="the horizontal axis, rounds or n (default: rounds)")
    p.add_argument("--eps0", type=positive_float, required=True, help=_EPS0_HELP)
    p.add_argument("--delta", type=probability, required=True, help=_DELTA_HELP)
    p.add_argument("--n", type=positive_int,
                   help="reports per round, an integer >= 1; required with --x rounds, unused with --x n")
    p.add_argument("--max-rounds", type=positive_int, default=100,
                   help="largest T, an integer >= 1 (with --x rounds; default: 100)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="rounds composed, an integer >= 1 (with --x n; default: 1)")
    p.add_argument("--n-min", type=positive_int, default=100,
                   help="smallest n, an integer >= 1 and < --n-max (with --x n; default: 100)")
    p.add_argument("--n-max", type=positive_int, default=1_000_000,
                   help="largest n, an integer > --n-min (with --x n; default: 1e6)")
    p.add_argument("--points", type=positive_int, default=20,
                   help="points per curve, an integer >= 1 (default: 20)")
    p.add_argument(
        "--bound", action="append", choices=family_names(), metavar="NAME",
        help=f"families to draw, each one of: {', '.join(family_names())} (repeatable; default: all but "
        "canonical-gdp)",
    )
    p.add_argument("--out", required=True, help="the PNG file to write (replaced if it exists); required")
    _add_common(p)
    p.set_defaults(handler=_cmd_plot)
    return parser
