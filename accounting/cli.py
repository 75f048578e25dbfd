"""``shuffledp account ...`` and ``shuffledp ledger ...``: privacy accounting from the command line.

The ``shuffledp`` dispatcher (``shuffledp.deploy.cli``) calls :func:`main` with ``argv[0]`` equal to ``"account"`` or
``"ledger"``. This module imports only the standard library and :mod:`accounting`; the numerical modules (numpy, scipy,
dp_accounting) are imported by the ``account`` commands when they run, matplotlib by ``plot`` only, so
``shuffledp ledger ...`` starts fast.

Contract (issue 2): with ``--json`` each command prints exactly one JSON object on stdout and exits 0; without
it, a readable table. Invalid or refused parameters exit 2 with the reason on stderr and nothing on stdout.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

from shuffledp.accounting import FAMILIES, Bound, RefusedError, format_bound
from shuffledp.accounting.ledger import Ledger, LedgerError

__all__ = ["main"]

EXIT_OK = 0
EXIT_USAGE = 2

_KIND_MEANING = {
    "upper": "guarantee (upper bound)",
    "approximate": "estimate, not a guarantee",
    "lower": "lower bound (true loss is at least this)",
    "refused": "refused",
}


#: What a calibrated eps0 means, by the kind of the family that calibrated it (the epsilon
#: meanings above read backwards for an eps0: from an upper bound the eps0 is the *safe* side, from a lower bound
#: it is a limit that is not itself safe).
_CALIBRATED_MEANING = {
    "upper": "certified: an upper bound on epsilon meets the target at this eps0 (and below it)",
    "approximate": "estimate: an approximation meets the target at this eps0; not a guarantee",
    "lower": "limit, not certified: a lower bound on epsilon exceeds the target above this eps0",
}


class _UsageError(Exception):
    """Raised instead of argparse's ``sys.exit(2)`` so that :func:`main` returns the code."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's hook for every usage error
        raise _UsageError(f"{self.prog}: error: {message}")


# -- argument types ----------------------------------------------------------------------------------------------
def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a real number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite real number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _finite_float(text)
    if value <= 0.0:
        raise argparse.ArgumentTypeError(f"expected a real number > 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    value = _finite_float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, got {text!r}")
    return value


def _order(text: str) -> float:
    value = _finite_float(text)
    if value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a Renyi order > 1, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    """An integer >= 1; accepts ``10000``, ``10_000`` and ``1e4`` (an exactly integral float)."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        if not math.isfinite(number) or not number.is_integer():
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _family_names() -> list[str]:
    return list(FAMILIES)


# -- output ------------------------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def _table(rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(len(r) for r in cells))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def _emit(obj: dict[str, Any], as_json: bool, out: TextIO, table: Callable[[], None]) -> int:
    if as_json:
        out.write(json.dumps(obj, allow_nan=False) + "\n")
    else:
        table()
    return EXIT_OK


def _finite_value(bound: Bound, what: str) -> float:
    value = float(bound.value)
    if not math.isfinite(value):
        raise ValueError(f"the {bound.family} bound gives no finite {what} for these parameters ({value!r})")
    return value


# -- account commands --------------------------------------------------------------------------------------------
def _single_result(obj: dict[str, Any], out: TextIO) -> None:
    meaning = obj.get("meaning", _KIND_MEANING[obj["kind"]])
    kind = f"{obj['kind']}: {meaning}"
    # rounded outward: an upper bound never prints below itself. A calibrated eps0 from an upper bound is the safe
    # side of the largest admissible eps0, so it rounds down (and one from a lower bound, a limit, rounds up).
    direction = {"upper": "lower", "lower": "upper"}.get(obj["kind"], obj["kind"]) if obj["quantity"] == "eps0" \
        else obj["kind"]
    rows = [("quantity", obj["quantity"]), ("value", format_bound(obj["value"], direction)), ("kind", kind)]
    rows += [(k, v) for k, v in obj.items() if k not in {"quantity", "value", "kind", "meaning"}]
    _table(rows, out)


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
    }
    return _emit(obj, args.json, out, lambda: _single_result(obj, out))


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
    }
    return _emit(obj, args.json, out, lambda: _single_result(obj, out))


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
    return _emit(obj, args.json, out, lambda: _single_result(obj, out))


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
    }
    return _emit(obj, args.json, out, lambda: _single_result(obj, out))


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
    for family in args.bound or _family_names():
        try:
            bound = bounds.epsilon(
                family, args.eps0, args.n, args.delta, args.rounds, allow_approximate=args.allow_approximate
            )
        except RefusedError as exc:
            results.append({"bound": family, "value": None, "kind": "refused", "reason": str(exc)})
            continue
        value = float(bound.value)
        if math.isfinite(value):
            results.append({"bound": family, "value": value, "kind": bound.kind, "reason": None, **_cap_fields(bound)})
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

    def table() -> None:
        out.write(
            f"epsilon at delta={_fmt(args.delta)} after {args.rounds} round(s) of n={args.n} shuffled reports, "
            f"each eps0={_fmt(args.eps0)}-LDP\n\n"
        )
        rows: list[Sequence[Any]] = [("bound", "epsilon", "kind", "meaning")]
        notes: list[str] = []
        for r in results:
            if r["reason"] is None and r.get("capped_by_no_shuffle"):
                notes.append(f"[{len(notes) + 1}] {r['bound']}: this is the no-shuffle value, which caps the family's "
                             f"own ({r['uncapped']}); still an upper bound")
                meaning = f"{_KIND_MEANING[r['kind']]}, capped, see [{len(notes)}]"
            elif r["reason"] is None:
                meaning = _KIND_MEANING[r["kind"]]
            else:
                notes.append(f"[{len(notes) + 1}] {r['bound']}: {r['reason']}")
                meaning = f"refused, see [{len(notes)}]"
            value = r["value"] if r["value"] is None else format_bound(r["value"], r["kind"])
            rows.append((r["bound"], value, r["kind"], meaning))
        _table(rows, out)
        if notes:
            out.write("\n" + "\n".join(notes) + "\n")

    return _emit(obj, args.json, out, table)


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
        title = f"eps0={_fmt(args.eps0)}, n={args.n}, delta={_fmt(args.delta)}"
    else:
        if args.n_max <= args.n_min:
            raise ValueError(f"plot --x n needs --n-min < --n-max, got {args.n_min} and {args.n_max}")
        xs = plot.integer_grid(args.n_min, args.n_max, args.points)
        curves = plot.epsilon_curves(
            families, x="n", xs=xs, eps0=args.eps0, delta=args.delta, rounds=args.rounds,
            allow_approximate=args.allow_approximate,
        )
        title = f"eps0={_fmt(args.eps0)}, T={args.rounds}, delta={_fmt(args.delta)}"
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
                "refusals": c.refusals,
            }
            for c in curves
        ],
    }

    def table() -> None:
        out.write(f"wrote {args.out}: epsilon vs {args.x} for {len(curves)} bound(s), {len(xs)} point(s) each\n")
        for c in curves:
            if c.refusals:
                out.write(f"  {c.family}: {len(c.refusals)} point(s) refused, e.g. {c.refusals[0]['reason']}\n")

    return _emit(obj, args.json, out, table)


# -- ledger commands ---------------------------------------------------------------------------------------------
def _cmd_ledger_show(args: argparse.Namespace, out: TextIO) -> int:
    with Ledger(args.path, read_only=True) as ledger:
        rows = ledger.rows()
        families = ledger.families()
    obj = {"path": str(args.path), "rows": rows}

    def table() -> None:
        if not rows:
            out.write(f"{args.path}: empty ledger (no round recorded)\n")
            return
        header: list[Any] = ["round", "time (UTC)", "n", "eps0", "mechanism", "delta"]
        header += [f"eps[{f}]" for f in families]
        body: list[Sequence[Any]] = [header]
        for row in rows:
            line: list[Any] = [row["round"], row["time"], row["n_reports"], row["eps0"], row["mechanism"], row["delta"]]
            for f in families:
                entry = row["epsilons"].get(f)
                if entry is None:
                    line.append("")
                elif entry["kind"] == "refused":
                    line.append("refused")
                else:
                    mark = {"upper": "", "approximate": " ~", "lower": " >="}[entry["kind"]]
                    line.append(f"{format_bound(entry['value'], entry['kind'], significant=6)}{mark}")
            body.append(line)
        _table(body, out)
        out.write("\n(no mark: upper bound, a guarantee; ~: approximation; >=: lower bound)\n")

    return _emit(obj, args.json, out, table)


def _cmd_ledger_export(args: argparse.Namespace, out: TextIO) -> int:
    with Ledger(args.path, read_only=True) as ledger:
        count = len(ledger)
        if args.format == "json":
            ledger.export_json(args.out)
        else:
            ledger.export_csv(args.out)
    obj = {"path": str(args.path), "format": args.format, "out": str(args.out), "rounds": count}
    return _emit(obj, args.json, out, lambda: out.write(f"wrote {count} round(s) to {args.out} ({args.format})\n"))


# -- parsers -----------------------------------------------------------------------------------------------------
def _add_common(p: argparse.ArgumentParser, *, allow_approximate: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of a table")
    if allow_approximate:
        p.add_argument(
            "--allow-approximate",
            action="store_true",
            help="let CLT approximations (ccg-gdp, ccg-rdp) answer even where they may fall below the exact "
            "value (n/(e^eps0+1) < 2 ln(1/delta)); otherwise they refuse",
        )


def _add_bound(p: argparse.ArgumentParser, extra: Sequence[str] = ()) -> None:
    names = [*_family_names(), *extra]
    p.add_argument(
        "--bound", default="clones", choices=names, metavar="NAME",
        help=f"bound family, one of: {', '.join(names)} (default: clones)",
    )


def _account_parser() -> _Parser:
    parser = _Parser(prog="shuffledp account", description="Privacy accounting for the shuffle model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("epsilon", help="epsilon at a given delta after T rounds")
    p.add_argument("--eps0", type=_positive_float, required=True, help="local epsilon of each report")
    p.add_argument("--n", type=_positive_int, required=True, help="number of shuffled reports per round")
    p.add_argument("--delta", type=_probability, required=True)
    p.add_argument("--rounds", type=_positive_int, default=1)
    _add_bound(p)
    _add_common(p)
    p.set_defaults(handler=_cmd_epsilon)

    p = sub.add_parser("delta", help="delta at a given epsilon after T rounds")
    p.add_argument("--eps0", type=_positive_float, required=True)
    p.add_argument("--n", type=_positive_int, required=True)
    p.add_argument("--epsilon", type=_finite_float, required=True)
    p.add_argument("--rounds", type=_positive_int, default=1)
    _add_bound(p)
    _add_common(p)
    p.set_defaults(handler=_cmd_delta)

    p = sub.add_parser("renyi", help="Renyi divergence of a given order after T rounds")
    p.add_argument("--eps0", type=_positive_float, required=True)
    p.add_argument("--n", type=_positive_int, required=True)
    p.add_argument("--order", type=_order, required=True, help="Renyi order alpha > 1")
    p.add_argument("--rounds", type=_positive_int, default=1)
    _add_bound(p, extra=("girgis-lower",))  # Girgis et al.'s lower bound is defined for Renyi divergences
    _add_common(p, allow_approximate=False)
    p.set_defaults(handler=_cmd_renyi)

    p = sub.add_parser("calibrate", help="largest eps0 such that T rounds of n reports stay within (epsilon, delta)")
    p.add_argument("--target-epsilon", type=_positive_float, required=True)
    p.add_argument("--delta", type=_probability, required=True)
    p.add_argument("--n", type=_positive_int, required=True)
    p.add_argument("--rounds", type=_positive_int, required=True)
    _add_bound(p)
    _add_common(p)
    p.set_defaults(handler=_cmd_calibrate)

    p = sub.add_parser("compare", help="epsilon of every bound family side by side")
    p.add_argument("--eps0", type=_positive_float, required=True)
    p.add_argument("--n", type=_positive_int, required=True)
    p.add_argument("--delta", type=_probability, required=True)
    p.add_argument("--rounds", type=_positive_int, default=1)
    p.add_argument(
        "--bound", action="append", choices=_family_names(), metavar="NAME",
        help="restrict to these families (repeatable; default: all)",
    )
    _add_common(p)
    p.set_defaults(handler=_cmd_compare)

    p = sub.add_parser("plot", help="PNG of epsilon vs rounds (or vs n) for several families")
    p.add_argument("--x", choices=("rounds", "n"), default="rounds", help="the horizontal axis (default: rounds)")
    p.add_argument("--eps0", type=_positive_float, required=True)
    p.add_argument("--delta", type=_probability, required=True)
    p.add_argument("--n", type=_positive_int, help="reports per round (with --x rounds)")
    p.add_argument("--max-rounds", type=_positive_int, default=100, help="largest T (with --x rounds; default 100)")
    p.add_argument("--rounds", type=_positive_int, default=1, help="rounds composed (with --x n; default 1)")
    p.add_argument("--n-min", type=_positive_int, default=100, help="smallest n (with --x n; default 100)")
    p.add_argument("--n-max", type=_positive_int, default=1_000_000, help="largest n (with --x n; default 1e6)")
    p.add_argument("--points", type=_positive_int, default=20, help="points per curve (default 20)")
    p.add_argument(
        "--bound", action="append", choices=_family_names(), metavar="NAME",
        help="families to draw (repeatable; default: all but canonical-gdp)",
    )
    p.add_argument("--out", required=True, help="the PNG file to write")
    _add_common(p)
    p.set_defaults(handler=_cmd_plot)
    return parser


def _ledger_parser() -> _Parser:
    parser = _Parser(prog="shuffledp ledger", description="Show or export a per-round privacy ledger.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("show", help="print every recorded round")
    p.add_argument("path", help="the ledger's SQLite file")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of a table")
    p.set_defaults(handler=_cmd_ledger_show)
    p = sub.add_parser("export", help="write the ledger as JSON or CSV")
    p.add_argument("path", help="the ledger's SQLite file")
    p.add_argument("--format", choices=("json", "csv"), required=True)
    p.add_argument("--out", required=True, help="the file to write")
    p.add_argument("--json", action="store_true", help="report what was written as one JSON object")
    p.set_defaults(handler=_cmd_ledger_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``account ...`` or ``ledger ...`` (``argv[0]`` names which); return the exit code.

    0 on success; 2 for invalid or refused parameters, with the reason on stderr and nothing on stdout.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    out, err = sys.stdout, sys.stderr
    if not args_list or args_list[0] not in {"account", "ledger"}:
        err.write("shuffledp: shuffledp.accounting.cli handles the commands 'account' and 'ledger'\n")
        return EXIT_USAGE
    parser = _account_parser() if args_list[0] == "account" else _ledger_parser()
    try:
        args = parser.parse_args(args_list[1:])
    except _UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    prog = f"shuffledp {args_list[0]} {args.command}"
    # Output is buffered and written only on success, so a failure never leaves a partial line on stdout.
    buffer = io.StringIO()
    try:
        code = int(args.handler(args, buffer))
    except RefusedError as exc:
        hint = " (on the command line: --allow-approximate)" if "allow_approximate" in str(exc) else ""
        err.write(f"{prog}: refused: {exc}{hint}\n")
    except (ValueError, TypeError, LedgerError) as exc:
        err.write(f"{prog}: error: {exc}\n")
    except ArithmeticError as exc:  # OverflowError, ZeroDivisionError, FloatingPointError, PLD re-check failures
        err.write(f"{prog}: error: numerical failure for these parameters ({type(exc).__name__}): {exc}\n")
    except RuntimeError as exc:  # e.g. a root finder that did not converge
        err.write(f"{prog}: error: the computation did not complete for these parameters: {exc}\n")
    except OSError as exc:
        err.write(f"{prog}: error: {exc}\n")
    else:
        out.write(buffer.getvalue())
        return code
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
