"""``shuffledp ledger show`` and ``shuffledp ledger export``: read a per-round privacy ledger.

Both open the ledger read-only (:class:`shuffledp.accounting.ledger.Ledger` with ``read_only=True``): SQLite
refuses every write, a missing ledger is an error (never a new empty database), and the folder is left as it was.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TextIO

from shuffledp.accounting import format_bound
from shuffledp.accounting.cli_common import Parser, emit, plural, table
from shuffledp.accounting.ledger import Ledger

__all__ = ["build_parser"]


def _versions_line(versions: dict[str, str] | None) -> str:
    if versions is None:
        return "versions: not recorded (a ledger created by an older shuffledp)\n"
    return "versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()) + "\n"


def _cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    with Ledger(args.path, read_only=True) as ledger:
        rows = ledger.rows()
        families = ledger.families()
        versions = ledger.versions()
    obj = {"path": str(args.path), "rows": rows, "versions": versions}

    def write_table() -> None:
        out.write(_versions_line(versions))
        if not rows:
            out.write(f"{args.path}: empty ledger (no round recorded)\n")
            return
        out.write("\n")
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
        table(body, out)
        out.write("\n(no mark: upper bound, a guarantee; ~: approximation; >=: lower bound)\n")

    return emit(obj, args.json, out, write_table)


def _cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    with Ledger(args.path, read_only=True) as ledger:
        count = len(ledger)
        if args.format == "json":
            ledger.export_json(args.out)
        else:
            ledger.export_csv(args.out)
    obj = {"path": str(args.path), "format": args.format, "out": str(args.out), "rounds": count}
    return emit(obj, args.json, out,
                lambda: out.write(f"wrote {plural(count, 'round')} to {args.out} ({args.format})\n"))


def build_parser() -> Parser:
    """Build the ``shuffledp ledger`` parser, each sub-command with its handler (``handler(args, out)``).

    Returns:
        The parser.
    """
    parser = Parser(prog="shuffledp ledger", description="Show or export a per-round privacy ledger (read-only).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    p = sub.add_parser("show", help="print the versions the ledger was created with and every recorded round")
    p.add_argument("path", help="the ledger's SQLite file (e.g. RUN_DIR/ledger.sqlite); it must exist")
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON object instead of a table (default: off)")
    p.set_defaults(handler=_cmd_show)
    p = sub.add_parser("export", help="write the ledger as JSON or CSV")
    p.add_argument("path", help="the ledger's SQLite file (e.g. RUN_DIR/ledger.sqlite); it must exist")
    p.add_argument("--format", choices=("json", "csv"), required=True,
                   help="the export format, json (one document) or csv (one line per round); required")
    p.add_argument("--out", required=True, help="the file to write (replaced atomically if it exists); required")
    p.add_argument("--json", action="store_true",
                   help="report what was written as one JSON object (default: off)")
    p.set_defaults(handler=_cmd_export)
    return parser
