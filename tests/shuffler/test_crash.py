"""Crash tests: ``kill -9`` a real shuffler process (mTLS, 127.0.0.1, port 0) and restart it on the same journal.

Exactly-once means: a batch that was acknowledged is served, after any number of crashes, with the bytes the
attestation's output digest commits to (``ShufflerClient.fetch_all`` checks count, lengths and digest), with no
report lost or duplicated; a batch that was not acknowledged leaves nothing behind (no output, no used binding,
no consumed replay tags), so the server can resend it; the replay cache and the used bindings survive a
restart; a torn journal tail is ignored and the journal stays appendable; damage that is not a torn tail stops
the service loudly instead of being guessed around.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import wire
from shuffledp.shuffler.client import ShufflerError
from shuffledp.shuffler.config import load_config
from shuffledp.shuffler.core import Header
from shuffledp.shuffler.envelope import ENVELOPE_VERSION
from shuffledp.shuffler.process import ShufflerStartError
from shuffledp.shuffler.service import core_from_config

from ._fixtures_adv import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    FETCH,
    SUBMIT,
    envelope_enc,
    envelope_msg,
    header_msg,
    open_all,
    process,
    raw_channel,
    read_journal,
    write_service_config,
)

RPC_TIMEOUT = 30.0


@pytest.fixture
def shuffler(kit, tmp_path: Path) -> Iterator[Any]:
    cfg = write_service_config(kit, tmp_path / "shuffler.toml")
    p = process(kit, cfg)
    p.start()
    try:
        yield p
    finally:
        p.kill()
        p.stop()


def _journal_dir(p: Any) -> Path:
    return load_config(p.config_path).journal_dir


def _honest(kit: Any, r: int, n: int = 6, size: int = 64) -> tuple[list[bytes], list[bytes]]:
    return [kit.seal(i, round_id=r, size=size) for i in range(n)], [kit.payload(i, size) for i in range(n)]


def _submit(kit: Any, p: Any, envs: list[bytes], r: int) -> Any:
    with kit.client(p.address) as c:
        return c.submit(round_id=r, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=envs)


def _fetch(kit: Any, p: Any, att: Any) -> list[bytes]:
    with kit.client(p.address) as c:
        return c.fetch_all(att)  # raises unless count, lengths and the attested output digest all match


def _crash_and_restart(p: Any) -> None:
    old = p.pid
    p.kill()  # SIGKILL: no handler, no flush, no cleanup in the child
    assert p.proc.returncode == -9
    p.start()
    assert p.pid != old and p.health() == "SERVING"


def _sealed_records(p: Any) -> list[dict]:
    return [r for r in read_journal(_journal_dir(p) / "journal.log") if r.get("type") == "batch"]


def test_kill_after_ack_before_fetch_serves_the_attested_bytes(kit, shuffler) -> None:
    envs, payloads = _honest(kit, 1)
    att = _submit(kit, shuffler, envs[:3] + [b"garbage", envs[0]] + envs[3:], 1)
    assert att.n_accepted == 6 and att.dropped["malformed"] == 1 and att.dropped["replay"] == 1
    _crash_and_restart(shuffler)  # accepted and acknowledged, never served
    first = _fetch(kit, shuffler, att)
    got = Counter(open_all(kit, first, 1))
    assert got == Counter(payloads) and sum(got.values()) == att.n_accepted  # nothing lost, nothing doubled
    assert _fetch(kit, shuffler, att) == first
    # crash again, this time leaving what an interrupted later commit would: an output renamed into batches/
    # whose commit record was never written, and a staging file. Both are removed and never served.
    shuffler.kill()
    jdir = _journal_dir(shuffler)
    orphan_id = bytes(range(16))
    (jdir / "batches" / f"{orphan_id.hex()}.out").write_bytes(first[0] * 3)
    (jdir / "staging" / "leftover.stage").write_bytes(b"x" * 100)
    shuffler.start()
    assert sorted(p.name for p in (jdir / "batches").iterdir()) == [f"{att.batch_id.hex()}.out"]
    assert list((jdir / "staging").iterdir()) == []
    assert _fetch(kit, shuffler, att) == first  # a sealed batch never changes
    with raw_channel(kit, shuffler.address) as ch:
        call = ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(call(pb.FetchRequest(batch_id=orphan_id).SerializeToString(), timeout=RPC_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with kit.client(shuffler.address) as c:
        s = c.stats()
    assert (s["batches_sealed"], s["reports_accepted"]) == (1, 6)
    assert s["dropped"]["malformed"] == 1 and s["dropped"]["replay"] == 1  # counters rebuilt from the journal


def test_kill_mid_fetch_then_fetch_again_is_identical(kit, shuffler) -> None:
    # items larger than the HTTP/2 window, so the server is still sending when it dies, and larger than half a
    # packed message, so that each travels alone
    size = wire.PACKED_MESSAGE_BYTES // 2 + 64 * 1024
    envs, payloads = _honest(kit, 2, n=8, size=size)
    att = _submit(kit, shuffler, envs, 2)
    # no BDP probing: the receive window stays at its 64 KiB default, so the client cannot have buffered the
    # whole stream before the kill (with probing it can grow to megabytes and swallow the batch)
    with raw_channel(kit, shuffler.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        call = ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)(
            pb.FetchRequest(batch_id=att.batch_id).SerializeToString(), timeout=RPC_TIMEOUT
        )
        first = [list(pb.FetchResponse.FromString(next(call)).inner) for _ in range(2)]
        assert [len(m) for m in first] == [1, 1]  # items above half the packing size travel one per message
        prefix = [m[0] for m in first]
        shuffler.kill()
        got = 2
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                got += 1
        assert got < 8  # the stream broke before the end: the kill really landed mid-fetch
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
    shuffler.start()
    full = _fetch(kit, shuffler, att)  # checked against the attested output digest
    assert full[:2] == prefix
    assert Counter(open_all(kit, full, 2)) == Counter(payloads)


def test_bindings_idempotency_and_replay_cache_survive_a_crash(kit, shuffler) -> None:
    envs, payloads = _honest(kit, 3)
    dropped = kit.seal(7, round_id=3)[:-1]  # undecryptable: must not enter the replay cache
    att = _submit(kit, shuffler, envs + [dropped], 3)
    first = _fetch(kit, shuffler, att)
    _crash_and_restart(shuffler)
    # the binding is still used: a different batch for round 3 is refused ...
    with pytest.raises(ShufflerError) as info:
        _submit(kit, shuffler, envs[:4] + [kit.seal(7, round_id=3)], 3)
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "binding_used")
    # ... while a retry of the identical submission still gets the original batch and bytes
    again = _submit(kit, shuffler, list(reversed(envs + [dropped])), 3)
    assert (again.batch_id, again.statement, again.signature) == (att.batch_id, att.statement, att.signature)
    assert _fetch(kit, shuffler, again) == first
    # the replay cache is rebuilt from the journal: every accepted enc, none of the dropped one
    shuffler.kill()
    cfg = load_config(shuffler.config_path)
    core = core_from_config(cfg)
    try:
        seen = core._seen_enc[kit.key_epoch]
        assert all(envelope_enc(e) in seen for e in envs) and envelope_enc(dropped) not in seen
        assert len(core._seen_rid[kit.key_epoch]) == len(envs)
        assert (kit.key_epoch, 3) in core._by_binding
    finally:
        core.close()
    shuffler.start()
    assert _fetch(kit, shuffler, att) == first
    assert Counter(open_all(kit, first, 3)) == Counter(payloads)


def _stalled_submit(kit: Any, p: Any, envs: list[bytes], r: int, *, send: int) -> tuple[threading.Thread, dict]:
    """Send the header and ``send`` envelopes, then keep the stream open; returns the thread and its result."""
    out: dict[str, Any] = {}
    release = threading.Event()
    out["release"] = release

    def requests() -> Iterator[bytes]:
        yield header_msg(kit, len(envs), round_id=r)
        for e in envs[:send]:
            yield envelope_msg(e)
        out["sent"] = True
        release.wait(20)

    def run() -> None:
        with raw_channel(kit, p.address) as ch:
            try:
                ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)(
                    requests(), timeout=RPC_TIMEOUT
                )
                out["result"] = "ok"
            except grpc.RpcError as exc:
                out["result"] = exc.code()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_kill_during_submit_leaves_nothing_behind(kit, shuffler) -> None:
    envs, payloads = _honest(kit, 4, size=64 * 1024)
    t, out = _stalled_submit(kit, shuffler, envs, 4, send=4)
    jdir = _journal_dir(shuffler)
    deadline = time.monotonic() + 10
    while not (out.get("sent") and any((jdir / "staging").iterdir())):
        assert time.monotonic() < deadline, "the shuffler never started staging the batch"
        time.sleep(0.01)
    time.sleep(0.2)  # let the server consume the envelopes already sent
    shuffler.kill()  # mid-batch: accepted envelopes staged, nothing sealed, nothing acknowledged
    out["release"].set()
    t.join(30)
    assert out["result"] == grpc.StatusCode.UNAVAILABLE
    shuffler.start()
    assert list((jdir / "staging").iterdir()) == [] and list((jdir / "batches").iterdir()) == []
    assert _sealed_records(shuffler) == []
    # nothing was consumed: the binding is free and the very same envelopes are accepted
    att = _submit(kit, shuffler, envs, 4)
    assert att.n_accepted == 6 and sum(att.dropped.values()) == 0
    assert Counter(open_all(kit, _fetch(kit, shuffler, att), 4)) == Counter(payloads)


KILL_FRACTIONS = (0.4, 0.9, 1.2)  # of a measured submit time: before, around and after the commit


def test_kill_around_the_commit_is_exactly_once(kit, shuffler) -> None:
    """SIGKILL at points spread over a submit. Whatever the moment, after a restart the identical resubmission
    yields exactly one sealed batch for the round, the batch id of the acknowledgement if there was one, and
    exactly the honest payloads."""
    size = 512 * 1024
    warm, _ = _honest(kit, 50, n=6, size=size)
    t0 = time.monotonic()
    _submit(kit, shuffler, warm, 50)
    duration = time.monotonic() - t0
    for j, fraction in enumerate(KILL_FRACTIONS):
        r = 60 + j
        envs, payloads = _honest(kit, r, n=6, size=size)
        acked: dict[str, Any] = {}

        def run() -> None:
            try:
                acked["att"] = _submit(kit, shuffler, envs, r)
            except ShufflerError as exc:
                acked["err"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        time.sleep(duration * fraction)
        shuffler.kill()
        t.join(30)
        assert ("att" in acked) != ("err" in acked)
        if "err" in acked:
            assert acked["err"].code == grpc.StatusCode.UNAVAILABLE
        shuffler.start()
        att = _submit(kit, shuffler, envs, r)  # the server's retry after a lost (or received) acknowledgement
        records = [x for x in _sealed_records(shuffler) if x["round_id"] == r]
        if "att" in acked:
            assert att.batch_id == acked["att"].batch_id and att.statement == acked["att"].statement
        assert len(records) == 1 and records[0]["batch_id"] == att.batch_id.hex()
        out = _fetch(kit, shuffler, att)
        assert Counter(open_all(kit, out, r)) == Counter(payloads) and len(out) == 6
    jdir = _journal_dir(shuffler)
    outputs = sorted(x["output"] for x in _sealed_records(shuffler))
    assert sorted(p.name for p in (jdir / "batches").iterdir()) == outputs


TORN_TAILS = {
    "partial_magic": lambda rec: b"SJ",
    "partial_body": lambda rec: rec[: len(rec) // 2],
    "all_but_last_byte": lambda rec: rec[:-1],
    "zero_fill": lambda rec: b"\0" * 4096,
}


def _record_bytes(jdir: Path, index: int) -> bytes:
    """The raw bytes of the index-th record of journal.log (magic, length, digest, body)."""
    data = (jdir / "journal.log").read_bytes()
    pos = 0
    for i in range(index + 1):
        length = int.from_bytes(data[pos + 4 : pos + 8], "big")
        end = pos + 40 + length
        if i == index:
            return data[pos:end]
        pos = end
    raise AssertionError("unreachable")


def test_torn_journal_tail_is_ignored_and_the_journal_stays_appendable(kit, shuffler) -> None:
    jdir = _journal_dir(shuffler)
    log_file = jdir / "journal.log"
    sealed: list[tuple[Any, list[bytes]]] = []
    envs, _ = _honest(kit, 20)
    att = _submit(kit, shuffler, envs, 20)
    sealed.append((att, _fetch(kit, shuffler, att)))
    for j, (name, make) in enumerate(TORN_TAILS.items()):
        shuffler.kill()
        good_size = log_file.stat().st_size
        # an append interrupted by the crash: a prefix of what a further commit record would have looked like
        with open(log_file, "ab") as fh:
            fh.write(make(_record_bytes(jdir, 0)))
        shuffler.start()
        assert log_file.stat().st_size == good_size, name  # cut back to the last good record
        assert "torn tail" in shuffler.log_tail(), name
        for att, first in sealed:
            assert _fetch(kit, shuffler, att) == first, name
        r = 21 + j
        envs, payloads = _honest(kit, r)
        att = _submit(kit, shuffler, envs, r)  # appended after the cut, not behind garbage
        out = _fetch(kit, shuffler, att)
        assert Counter(open_all(kit, out, r)) == Counter(payloads), name
        sealed.append((att, out))
    _crash_and_restart(shuffler)
    for att, first in sealed:
        assert _fetch(kit, shuffler, att) == first
    assert len(_sealed_records(shuffler)) == len(TORN_TAILS) + 1


def _sealed_offline(kit: Any, cfg: Path, rounds: tuple[int, ...]) -> list[Any]:
    """Seal batches with the in-process core on the config's journal (no process start needed)."""
    core = core_from_config(load_config(cfg))
    try:
        out = []
        for r in rounds:
            envs, _ = _honest(kit, r)
            b = core.begin(Header(protocol_version=ENVELOPE_VERSION, key_epoch=kit.key_epoch, round_id=r,
                                  model_digest=kit.digest, expected_count=len(envs)))
            for e in envs:
                b.add(e)
            out.append(b.finish())
        return out
    finally:
        core.close()


def test_damage_before_the_tail_stops_the_service_loudly(kit, tmp_path: Path) -> None:
    cfg = write_service_config(kit, tmp_path / "shuffler.toml")
    _sealed_offline(kit, cfg, (8, 9))
    log_file = load_config(cfg).journal_dir / "journal.log"
    data = bytearray(log_file.read_bytes())
    data[60] ^= 0x01  # inside the first record's body; a second, intact record follows
    log_file.write_bytes(bytes(data))
    p = process(kit, cfg)
    try:
        with pytest.raises(ShufflerStartError, match="JournalCorrupt|further data"):
            p.start()
    finally:
        p.kill()


def test_truncated_sealed_output_stops_the_service_loudly(kit, tmp_path: Path) -> None:
    cfg = write_service_config(kit, tmp_path / "shuffler.toml")
    (sealed,) = _sealed_offline(kit, cfg, (10,))
    with open(sealed.output, "r+b") as fh:
        fh.truncate(sealed.output.stat().st_size - 1)
    p = process(kit, cfg)
    try:
        with pytest.raises(ShufflerStartError, match="missing or not"):
            p.start()
    finally:
        p.kill()


def test_output_damaged_on_disk_is_never_served_as_good(kit, running) -> None:
    """If a sealed output file is truncated or altered behind the service's back (disk fault, operator error),
    Fetch must not pass off wrong bytes: a truncated file ends the stream with an error, and altered bytes are
    caught by the client's check against the attested output digest."""
    from shuffledp.shuffler.attestation import AttestationError

    envs, _ = _honest(kit, 12)
    with kit.client(running.address) as c:
        att = c.submit(round_id=12, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=envs)
        out = running.core.lookup(att.batch_id).output
        data = out.read_bytes()
        out.write_bytes(data[:-1])
        # the retained staging buffer still holds the good output and Fetch would serve it from there; once a
        # later batch has taken the buffer, Fetch reads the file
        running.core.take_buffer(0).close()
        with pytest.raises(ShufflerError) as info:
            c.fetch_all(att)
        # INTERNAL, as documented for unexpected errors, with a generic message: no file name, id or data
        assert info.value.code == grpc.StatusCode.INTERNAL, info.value.details
        assert data.hex()[:64] not in info.value.details and att.batch_id.hex() not in info.value.details
        out.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        with pytest.raises(AttestationError, match="output digest"):
            c.fetch_all(att)


_FAILED_APPEND_SCRIPT = r"""
import json, os, resource, signal, sys
from pathlib import Path
from shuffledp.shuffler.config import load_config
from shuffledp.shuffler.core import Header
from shuffledp.shuffler.envelope import ENVELOPE_VERSION
from shuffledp.shuffler.service import core_from_config

cfg_path, env_dir = sys.argv[1], Path(sys.argv[2])
cfg = load_config(cfg_path)
core = core_from_config(cfg)
meta = json.loads((env_dir / "meta.json").read_text())

def seal_round(r):
    envs = [p.read_bytes() for p in sorted(env_dir.glob(f"r{r}-*.env"))]
    b = core.begin(Header(protocol_version=ENVELOPE_VERSION, key_epoch=meta["key_epoch"], round_id=r,
                          model_digest=bytes.fromhex(meta["digest"]), expected_count=len(envs)))
    for e in envs:
        b.add(e)
    return b.finish()

a = seal_round(13)
# B: the file-size limit cuts its journal record half-way (a short write, then EFBIG): a real failed append
log = cfg.journal_dir / "journal.log"
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (log.stat().st_size + 500, hard))
try:
    seal_round(14)
    b_failed = ""
except Exception as exc:  # an OSError, or the service's refusal that wraps it (disk_full)
    b_failed = type(exc).__name__ + ": " + str(exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
c = seal_round(15)  # acknowledged: finish() returned
core.close()
print(json.dumps({"a": a.batch_id.hex(), "c": c.batch_id.hex(), "b_failed": b_failed}))
"""


def test_a_failed_journal_append_does_not_cost_a_later_acknowledged_batch(kit, tmp_path: Path) -> None:
    """Batch A is sealed; the commit of batch B fails half-way through writing its journal record (here a file
    size limit: a short write, then EFBIG; in production a full disk or an I/O error); the service stays up and
    seals batch C, which is acknowledged. After a restart the journal must open, and A and C must be there
    with their outputs: an acknowledged commit may never be lost to, or blocked by, the debris of a failed one.
    B itself may survive (its remaining bytes can reach the file with the next append), like a batch whose
    acknowledgement was lost; then it must be whole, and an identical retry must get B's own attestation.

    Runs the core in a child process, because the fault is injected with RLIMIT_FSIZE."""
    import json
    import subprocess
    import sys

    cfg = write_service_config(kit, tmp_path / "shuffler.toml")
    env_dir = tmp_path / "envelopes"
    env_dir.mkdir()
    b_envs = []
    for r in (13, 14, 15):
        for j, e in enumerate(_honest(kit, r)[0]):
            (env_dir / f"r{r}-{j}.env").write_bytes(e)
            if r == 14:
                b_envs.append(e)
    (env_dir / "meta.json").write_text(json.dumps({"key_epoch": kit.key_epoch, "digest": kit.digest.hex()}))
    run = subprocess.run([sys.executable, "-c", _FAILED_APPEND_SCRIPT, str(cfg), str(env_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    ids = json.loads(run.stdout.strip().splitlines()[-1])
    assert ids["b_failed"], "the injected fault did not make B's commit fail"
    recovered = core_from_config(load_config(cfg))  # raises JournalCorrupt if the debris sits mid-journal
    try:
        by_round = {sb.round_id: sb for sb in recovered._sealed.values()}
        assert by_round[13].batch_id.hex() == ids["a"] and by_round[15].batch_id.hex() == ids["c"]
        assert set(by_round) <= {13, 14, 15}
        for sb in by_round.values():
            assert len(list(recovered.read_batch(sb.batch_id))) == 6
        b = recovered.begin(Header(protocol_version=ENVELOPE_VERSION, key_epoch=kit.key_epoch, round_id=14,
                                   model_digest=kit.digest, expected_count=len(b_envs)))
        for e in b_envs:
            b.add(e)
        retry = b.finish()
        if 14 in by_round:
            assert retry.batch_id == by_round[14].batch_id and retry.statement == by_round[14].statement
        assert len(list(recovered.read_batch(retry.batch_id))) == 6
    finally:
        recovered.close()
