"""The service's TOML configuration (``shuffledp shuffler serve --config FILE``).

Relative paths are resolved against the directory of the config file. Unknown keys are an error (a typo must
not silently fall back to a default)::

    address = "127.0.0.1:0"            # host:port; port 0 picks a free port (reported via --port-file)
    key_epoch = 0                      # the only epoch this process accepts
    k = 10                             # release threshold: distinct enrolled signers per batch
    max_envelope_bytes = 67108864      # larger envelopes are dropped; gRPC message limits derive from it
    max_batch_reports = 100000         # optional; at most 1000000
    submit_idle_timeout = 60           # optional; seconds a Submit stream may stall between messages
    submit_max_duration = 21600        # optional; seconds a Submit stream may stay open in all (keepalives too)
    fetch_stall_timeout = 60           # optional; seconds a Fetch's peer may leave a message untaken, plus
    fetch_min_rate = 65536             # optional; the message's size / this (bytes/s): the slowest link served
    staging_memory_limit = 1073741824  # optional; bytes; a batch up to this size is staged in memory
    retain_staging_buffer = true       # optional; keep that memory mapped between batches and reuse it
    heap_tuning = true                 # optional; glibc reuses heap memory for messages (shuffler/heap.py)
    verify_threads = 0                 # optional; threads that open and check reports, shared; 0 = inline;
                                       # default: the CPUs less two, 0 to 2
    hpke_key = "shuffler/hpke.key"     # X25519, 0600
    signing_key = "shuffler/signing.key"  # Ed25519, 0600
    enrolment = "enrolment.json"
    journal_dir = "journal"
    insecure = false                   # optional; true = no TLS, allowed only on a loopback address (tests)

    [tls]                              # required unless insecure = true
    ca = "tls/ca.crt"                  # CA that issued the allowed clients' certificates (mTLS is required)
    cert = "tls/shuffler.crt"
    key = "tls/shuffler.key"
    client_common_names = ["serverapp"]   # optional: only these certificate CNs may call the service
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shuffledp.shuffler.validation import is_int

# The limits below are the core's too (shuffledp.shuffler.batch imports them from here): config imports nothing of
# the core, so it loads without the core's crypto dependencies.
#: Default ``staging_memory_limit``: a batch of at most this many bytes (expected_count x inner length) is
#: staged in memory and written to disk once, at seal time; a larger batch is staged in a zero-filled file.
DEFAULT_STAGING_MEMORY_LIMIT = 1024**3
#: Upper bound accepted for ``staging_memory_limit`` (1 TiB).
MAX_STAGING_MEMORY_LIMIT = 1 << 40
#: Upper bound accepted for ``verify_threads``.
MAX_VERIFY_THREADS = 64


def default_verify_threads() -> int:
    """The default ``verify_threads``: the CPUs this process may run on less two, from 0 to 2 (returns that count).

    A submit's own thread and gRPC's threads (TLS, HTTP/2, the client on the same host) keep two cores busy; a
    worker pays only where there is a third. Since the outer open releases the GIL for all but a few microseconds
    (:mod:`shuffledp.shuffler.hpke_open`), the submitting thread's crypto overlaps gRPC's C threads by itself: on
    the 2-core benchmark VM opening and checking inline took 0.919 and 0.958 of the time of one worker per
    submit + fetch pair at 1,000 x 100 KiB (10 and 8 interleaved pairs, 9% fewer CPU seconds) and 0.996 at
    200 x 1 MiB (8 pairs); one worker took 0.947, 0.983 and 0.962 of the time of two (10-12 pairs each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(2, cpus - 2))


__all__ = ["ServiceConfig", "TLSConfig", "load_config", "ConfigError", "default_verify_threads"]

_TOP = {
    "address",
    "key_epoch",
    "k",
    "max_envelope_bytes",
    "max_batch_reports",
    "hpke_key",
    "signing_key",
    "enrolment",
    "journal_dir",
    "insecure",
    "submit_idle_timeout",
    "submit_max_duration",
    "fetch_stall_timeout",
    "fetch_min_rate",
    "staging_memory_limit",
    "retain_staging_buffer",
    "heap_tuning",
    "verify_threads",
    "tls",
}
_TLS = {"ca", "cert", "key", "client_common_names"}
_REQUIRED = ("address", "key_epoch", "k", "max_envelope_bytes", "hpke_key", "signing_key", "enrolment", "journal_dir")


class ConfigError(ValueError):
    """The configuration file is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class TLSConfig:
    """The ``[tls]`` table: mTLS files (resolved paths) and the certificate CNs allowed to call, if limited."""

    ca: Path
    cert: Path
    key: Path
    client_common_names: tuple[str, ...] | None


@dataclass(frozen=True)
class ServiceConfig:
    """A loaded configuration file: every key of the module docstring, paths resolved, defaults filled in."""

    address: str
    key_epoch: int
    k: int
    max_envelope_bytes: int
    max_batch_reports: int
    hpke_key: Path
    signing_key: Path
    enrolment: Path
    journal_dir: Path
    insecure: bool
    tls: TLSConfig | None
    submit_idle_timeout: float = 60.0  # seconds a Submit stream may wait for its next message
    #: seconds a Submit stream may stay open in all: keepalives reset the idle timer, not this one, so a stream of
    #: keepalives cannot hold a submit slot forever. Above any round's reply timeout.
    submit_max_duration: float = 21600.0
    fetch_stall_timeout: float = 60.0  # seconds a Fetch may wait for its peer to take the next message, plus
    fetch_min_rate: int = 65536  # ... the message's size divided by this rate (bytes/s)
    #: a batch of at most this many bytes (expected_count x inner length) is staged in memory and written to
    #: disk once at seal; a larger one is staged in a zero-filled file (see docs/shuffler.md); 0 = always disk
    staging_memory_limit: int = DEFAULT_STAGING_MEMORY_LIMIT
    #: keep the memory path's staging buffer mapped after a sealed batch and reuse it (idle memory up to
    #: staging_memory_limit; saves faulting in fresh pages per batch); false = unmap after every batch
    retain_staging_buffer: bool = True
    #: fix glibc's mmap/trim thresholds at startup so message buffers are reused (shuffler/heap.py); costs up
    #: to its trim threshold (256 MiB) of idle free heap
    heap_tuning: bool = True
    #: threads that open reports into their slots and check their signatures while a submit stream receives the
    #: next envelopes; 0 = inline (shuffledp.shuffler.core.CoreConfig.verify_threads); default:
    #: :func:`default_verify_threads`
    verify_threads: int = field(default_factory=default_verify_threads)


def _seconds(doc: dict[str, Any], key: str, default: float, where: Path, *, high: float = 3600) -> float:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.1 <= v <= high:
        raise ConfigError(f"{where}: {key} must be a number of seconds in [0.1, {high:g}], got {v!r}")
    return float(v)


def _int(doc: dict[str, Any], key: str, lo: int, hi: int, where: Path, *, default: int | None = None) -> int:
    """``doc[key]`` (or ``default`` for an optional key that is absent), an integer in [lo, hi]."""
    v = doc[key] if default is None else doc.get(key, default)
    if not is_int(v) or not lo <= v <= hi:
        raise ConfigError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _path(doc: dict[str, Any], key: str, base: Path, where: Path) -> Path:
    v = doc[key]
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}: {key} must be a non-empty path string, got {v!r}")
    p = Path(v)
    return p if p.is_absolute() else base / p


def is_loopback(address: str) -> bool:
    """True if ``host:port`` names a loopback host."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(path: str | os.PathLike[str]) -> ServiceConfig:
    """Parse and validate the config file. Raises :class:`ConfigError` with what was wrong."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    base = path.resolve().parent
    unknown = set(doc) - _TOP
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(_TOP)}")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise ConfigError(f"{path}: missing required keys {missing}")
    address = doc["address"]
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"{path}: address must be 'host:port' (port 0 for any free port), got {address!r}")
    insecure = doc.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"{path}: insecure must be true or false, got {insecure!r}")
    tls_doc = doc.get("tls")
    tls: TLSConfig | None = None
    if insecure:
        if not is_loopback(address):
            raise ConfigError(f"{path}: insecure = true is only allowed on a loopback address, not {address!r}")
        if tls_doc is not None:
            raise ConfigError(f"{path}: insecure = true and a [tls] table are contradictory; remove one")
    else:
        if not isinstance(tls_doc, dict):
            raise ConfigError(f"{path}: a [tls] table (ca, cert, key) is required unless insecure = true")
        unknown = set(tls_doc) - _TLS
        if unknown:
            raise ConfigError(f"{path}: unknown keys in [tls] {sorted(unknown)}; allowed: {sorted(_TLS)}")
        for key in ("ca", "cert", "key"):
            if key not in tls_doc:
                raise ConfigError(f"{path}: [tls] needs {key} (mutual TLS is required)")
        names = tls_doc.get("client_common_names")
        if names is not None and (
            not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names)
        ):
            raise ConfigError(f"{path}: [tls] client_common_names must be a non-empty list of strings")
        tls = TLSConfig(
            ca=_path(tls_doc, "ca", base, path),
            cert=_path(tls_doc, "cert", base, path),
            key=_path(tls_doc, "key", base, path),
            client_common_names=tuple(names) if names is not None else None,
        )
    flags = {}
    for key in ("retain_staging_buffer", "heap_tuning"):
        flags[key] = doc.get(key, True)
        if not isinstance(flags[key], bool):
            raise ConfigError(f"{path}: {key} must be true or false, got {flags[key]!r}")
    return ServiceConfig(
        address=address,
        key_epoch=_int(doc, "key_epoch", 0, 2**32 - 1, path),
        k=_int(doc, "k", 1, 10**9, path),
        max_envelope_bytes=_int(doc, "max_envelope_bytes", 1024, 2**31 - 65536, path),
        max_batch_reports=_int(doc, "max_batch_reports", 1, 10**6, path, default=100_000),
        submit_idle_timeout=_seconds(doc, "submit_idle_timeout", 60.0, path),
        submit_max_duration=_seconds(doc, "submit_max_duration", 21600.0, path, high=7 * 86400),
        fetch_stall_timeout=_seconds(doc, "fetch_stall_timeout", 60.0, path),
        fetch_min_rate=_int(doc, "fetch_min_rate", 1024, 10**10, path, default=65536),
        staging_memory_limit=_int(
            doc, "staging_memory_limit", 0, MAX_STAGING_MEMORY_LIMIT, path, default=DEFAULT_STAGING_MEMORY_LIMIT
        ),
        retain_staging_buffer=flags["retain_staging_buffer"],
        heap_tuning=flags["heap_tuning"],
        verify_threads=_int(doc, "verify_threads", 0, MAX_VERIFY_THREADS, path, default=default_verify_threads()),
        hpke_key=_path(doc, "hpke_key", base, path),
        signing_key=_path(doc, "signing_key", base, path),
        enrolment=_path(doc, "enrolment", base, path),
        journal_dir=_path(doc, "journal_dir", base, path),
        insecure=insecure,
        tls=tls,
    )
