"""``shuffledp shuffler ...`` and ``shuffledp keys ...``.

    shuffledp shuffler serve --config FILE [--port-file PATH] [--log-level LEVEL]
    shuffledp shuffler journal --journal-dir DIR   (read-only: one JSON line per sealed batch, released or not)
    shuffledp keys init --out DIR --clients N [--key-epoch E] [--k K] [--max-envelope-bytes B]   (simulations)
    shuffledp keys client --out DIR --client-id ID            (on a device: its own signing key pair)
    shuffledp keys enrol --enrolment FILE --client-id ID --public-key PATH   (operator: add a client's key)

``python -m shuffledp.shuffler.cli shuffler serve ...`` is the same as ``shuffledp shuffler serve ...``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _shuffler_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shuffledp shuffler", description="the shuffler service")
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("serve", help="run the shuffler service until SIGTERM")
    s.add_argument("--config", required=True, help="TOML config file (see docs/shuffler.md)")
    s.add_argument("--port-file", help="write the bound port here once serving (for port 0)")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging threshold of the service (default INFO)")
    j = sub.add_parser(
        "journal",
        help="list the sealed batches in a journal and whether each was released (fetched); reads only, so it is "
        "safe on a running shuffler's journal",
    )
    j.add_argument("--journal-dir", required=True, help="the service's journal_dir")
    return p


def journal_listing(journal_dir: str) -> tuple[list[dict[str, object]], int | None]:
    """One dict per sealed batch of the journal in ``journal_dir``, in commit order, and the offset of a torn
    tail (None if none). Each dict: ``batch_id``, ``key_epoch``, ``round_id``, ``n`` (the attested count),
    ``statement`` and ``signature`` (the attestation, as :meth:`shuffledp.shuffler.attestation.Attestation.to_dict`
    writes it), ``released`` (a Fetch began: its release record is in the journal) and ``released_at``
    (Unix seconds, or None). Reads only (:func:`shuffledp.shuffler.journal.read_records`).

    Raises FileNotFoundError if there is no ``journal.log``, :class:`shuffledp.shuffler.journal.JournalCorrupt` if it
    is damaged other than by a torn tail.
    """
    from pathlib import Path

    from shuffledp.shuffler.journal import read_records

    path = Path(journal_dir) / "journal.log"
    if not path.is_file():
        raise FileNotFoundError(f"no journal at {path} (is --journal-dir the service's journal_dir?)")
    records, torn_at = read_records(path)
    released = {r["batch_id"]: r for r in records if r.get("type") == "release"}
    rows: list[dict[str, object]] = []
    for r in records:
        if r.get("type") != "batch":
            continue
        rel = released.get(r["batch_id"])
        rows.append(
            {
                "batch_id": r["batch_id"],
                "key_epoch": r["key_epoch"],
                "round_id": r["round_id"],
                "n": r["n"],
                "statement": r["statement"],
                "signature": r["signature"],
                "released": rel is not None,
                "released_at": None if rel is None else rel["released_at"],
            }
        )
    return rows, torn_at


def _keys_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shuffledp keys", description="keys, certificates and enrolment")
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("init", help="create a complete key directory (see docs/interfaces.md)")
    s.add_argument("--out", required=True, help="directory to create (must not hold keys already)")
    s.add_argument("--clients", type=int, required=True, help="number of clients to enrol (ids client-0..N-1)")
    s.add_argument("--key-epoch", type=int, default=0,
                   help="key epoch the keys belong to (default 0; rotate keys by using a new epoch)")
    s.add_argument("--k", type=int, default=None, help="release threshold (default min(N, max(2, N // 2)))")
    s.add_argument("--max-envelope-bytes", type=int, default=None,
                   help="largest envelope the shuffler accepts, written to its config (default: the config's default)")
    c = sub.add_parser("client", help="make one client's Ed25519 signing key pair (run on the device)")
    c.add_argument("--out", required=True, help="directory for ID.key (0600) and ID.pub")
    c.add_argument("--client-id", required=True, help="the client's identifier in the enrolment")
    e = sub.add_parser("enrol", help="add a client's public key to the enrolment file (shuffler operator)")
    e.add_argument("--enrolment", required=True, help="enrolment.json (created if missing)")
    e.add_argument("--client-id", required=True, help="the identifier to enrol the client's public key under")
    e.add_argument("--public-key", required=True, help="the client's Ed25519 public key (PEM, from keys client)")
    return p


def _run_shuffler(args: list[str]) -> int:
    ns = _shuffler_parser().parse_args(args)
    if ns.verb == "journal":
        return _list_journal(ns.journal_dir)
    logging.basicConfig(
        level=getattr(logging, ns.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from shuffledp.shuffler.config import ConfigError
    from shuffledp.shuffler.service import serve

    try:
        return serve(ns.config, port_file=ns.port_file)
    except (ConfigError, FileNotFoundError, PermissionError, ValueError) as exc:
        sys.stderr.write(f"shuffledp shuffler: {exc}\n")
        return 2


def _list_journal(journal_dir: str) -> int:
    import json

    from shuffledp.shuffler.journal import JournalCorrupt

    try:
        rows, torn_at = journal_listing(journal_dir)
    except (FileNotFoundError, JournalCorrupt, OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"shuffledp shuffler journal: {exc}\n")
        return 2
    for row in rows:
        sys.stdout.write(json.dumps(row, sort_keys=True) + "\n")
    released = sum(1 for r in rows if r["released"])
    sys.stderr.write(
        f"{len(rows)} sealed batch(es), {released} released, {sum(int(r['n']) for r in rows if r['released'])} "
        f"reports released\n"
    )
    if torn_at is not None:
        sys.stderr.write(f"the journal ends in a torn tail at byte {torn_at} (the service cuts it off when it opens)\n")
    return 0


def _run_keys(args: list[str]) -> int:
    ns = _keys_parser().parse_args(args)
    from shuffledp.shuffler.keys import DEFAULT_MAX_ENVELOPE_BYTES, create_client_key, enrol_client, init_key_directory

    if ns.verb == "client":
        try:
            _, pub = create_client_key(ns.out, ns.client_id)
        except (ValueError, OSError) as exc:  # OSError: the key exists, or the directory cannot be written
            sys.stderr.write(f"shuffledp keys client: {exc}\n")
            return 2
        sys.stdout.write(f"wrote the signing key pair of {ns.client_id}; give only {pub} to the operator\n")
        return 0
    if ns.verb == "enrol":
        try:
            enrol_client(ns.enrolment, ns.client_id, ns.public_key)
        except (ValueError, OSError) as exc:
            sys.stderr.write(f"shuffledp keys enrol: {exc}\n")
            return 2
        sys.stdout.write(f"enrolled {ns.client_id} in {ns.enrolment}\n")
        return 0
    try:
        d = init_key_directory(
            ns.out,
            ns.clients,
            key_epoch=ns.key_epoch,
            k=ns.k,
            max_envelope_bytes=ns.max_envelope_bytes or DEFAULT_MAX_ENVELOPE_BYTES,
        )
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"shuffledp keys: {exc}\n")
        return 2
    sys.stdout.write(f"wrote key directory {d.root} ({ns.clients} enrolled clients); config {d.config}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; ``argv[0]`` is ``"shuffler"`` or ``"keys"``. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("shuffler", "keys"):
        sys.stderr.write("usage: shuffledp {shuffler serve --config FILE | keys init --out DIR --clients N}\n")
        return 2
    try:
        if args[0] == "shuffler":
            return _run_shuffler(args[1:])
        return _run_keys(args[1:])
    except SystemExit as exc:  # argparse
        return int(exc.code) if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    raise SystemExit(main())
