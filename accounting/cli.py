"""``shuffledp account ...`` and ``shuffledp ledger ...``: privacy accounting from the command line.

The ``shuffledp`` dispatcher (``shuffledp.deploy.cli``) calls :func:`main` with ``argv[0]`` equal to ``"account"`` or
``"ledger"``. The commands live in :mod:`shuffledp.accounting.cli_account` and :mod:`shuffledp.accounting.cli_ledger`,
what they share in :mod:`shuffledp.accounting.cli_common`. These modules import only the standard library and
:mod:`shuffledp.accounting`; the numerical modules (numpy, scipy, dp_accounting) are imported by the ``account``
commands when they run, matplotlib by ``plot`` only, so ``shuffledp ledger ...`` starts fast.

Contract: with ``--json`` each command prints exactly one JSON object on stdout and exits 0; without it, a readable
table. Invalid or refused parameters exit 2 with the reason on stderr and nothing on stdout.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence

from shuffledp.accounting import RefusedError
from shuffledp.accounting.cli_common import EXIT_USAGE, UsageError, cli_message
from shuffledp.accounting.ledger import LedgerError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``account ...`` or ``ledger ...`` (``argv[0]`` names which); return the exit code.

    Args:
        argv: the command name and its arguments; ``sys.argv[1:]`` if None.

    Returns:
        0 on success; 2 for invalid or refused parameters, with the reason on stderr and nothing on stdout.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    out, err = sys.stdout, sys.stderr
    if not args_list or args_list[0] not in {"account", "ledger"}:
        err.write("shuffledp: shuffledp.accounting.cli handles the commands 'account' and 'ledger'\n")
        return EXIT_USAGE
    if args_list[0] == "account":
        from shuffledp.accounting.cli_account import build_parser
    else:
        from shuffledp.accounting.cli_ledger import build_parser
    parser = build_parser()
    try:
        args = parser.parse_args(args_list[1:])
    except UsageError as exc:
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
        err.write(f"{prog}: refused: {cli_message(str(exc))}\n")
    except (ValueError, TypeError, LedgerError) as exc:
        err.write(f"{prog}: error: {cli_message(str(exc))}\n")
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
