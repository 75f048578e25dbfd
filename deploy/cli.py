"""The ``shuffledp`` command: a thin dispatcher to each package's own CLI.

Sub-commands are imported lazily so that ``shuffledp account`` (pure maths) never imports torch, flwr or
grpc, and ``shuffledp shuffler serve`` never imports torch or flwr.

    shuffledp account ...        -> shuffledp.accounting.cli
    shuffledp ledger ...         -> shuffledp.accounting.cli
    shuffledp shuffler ...       -> shuffledp.shuffler.cli
    shuffledp keys ...           -> shuffledp.shuffler.cli
    shuffledp run|resume ...     -> shuffledp.deploy.runner
    shuffledp deploy ...         -> shuffledp.deploy.deploy_cli
    shuffledp audit ...          -> shuffledp.deploy.audit_cli
    shuffledp sweep ...          -> shuffledp.deploy.sweep
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

_ROUTES: dict[str, str] = {
    "account": "shuffledp.accounting.cli",
    "ledger": "shuffledp.accounting.cli",
    "shuffler": "shuffledp.shuffler.cli",
    "keys": "shuffledp.shuffler.cli",
    "run": "shuffledp.deploy.runner",
    "resume": "shuffledp.deploy.runner",
    "deploy": "shuffledp.deploy.deploy_cli",
    "audit": "shuffledp.deploy.audit_cli",
    "sweep": "shuffledp.deploy.sweep",
}

_USAGE = """usage: shuffledp <command> [...]   (shuffledp --version: the installed version)

commands:
  account    privacy accounting for the shuffle model (epsilon, delta, renyi, calibrate, compare, plot)
  ledger     show or export a per-round privacy ledger
  shuffler   run the shuffler service (shuffler serve --config FILE)
  keys       create keys, certificates and the enrolment file
  run        run the main job (Flower simulation on the bundled digits data)
  resume     continue a killed run from its last checkpoint
  deploy     local multi-process TLS deployment
  audit      check that every batch the shuffler released was charged in the ledger
  sweep      in-process study over mechanisms, eps0 or target epsilon, rounds and seeds: one table, one figure
"""


def version() -> str:
    """The installed shuffledp's version (its distribution metadata), or ``unknown`` when it is not installed."""
    try:
        return metadata.version("shuffledp")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``shuffledp <command> ...`` to the module that owns the command.

    Each target module exposes ``main(argv: list[str]) -> int`` where ``argv[0]`` is the command name.
    Returns the process exit code (2 for usage errors, as argparse does).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        sys.stdout.write(_USAGE)
        return 0 if args else 2
    if args[0] in {"-V", "--version", "version"}:
        sys.stdout.write(f"shuffledp {version()}\n")
        return 0
    module_name = _ROUTES.get(args[0])
    if module_name is None:
        close = difflib.get_close_matches(args[0], list(_ROUTES), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        sys.stderr.write(f"shuffledp: unknown command {args[0]!r}; {hint}the commands are {', '.join(_ROUTES)} "
                         "(shuffledp --help says what each does)\n")
        return 2
    module = importlib.import_module(module_name)
    return int(module.main(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
