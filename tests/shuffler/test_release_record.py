"""The shuffler's own record of which sealed batches were released (fetched), for an auditor.

Nothing of a batch leaves before its release record is durable; the record is written once per batch and survives
a restart; ``shuffledp shuffler journal`` lists it without touching the journal of a running shuffler.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from shuffledp.shuffler.cli import journal_listing, main
from shuffledp.shuffler.core import Refused, ShufflerCore
from shuffledp.shuffler.journal import read_records


def _seal(core: ShufflerCore, kit, n: int, round_id: int):
    b = core.begin(kit.header(n, round_id=round_id))
    for i in range(n):
        b.add(kit.seal(i, round_id=round_id))
    return b.finish()


def _releases(core: ShufflerCore) -> list[dict]:
    return [r for r in read_records(core.journal.path)[0] if r.get("type") == "release"]


def test_first_fetch_is_journalled_once_and_survives_restart(kit, tmp_path: Path) -> None:
    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    a = _seal(core, kit, 5, round_id=1)
    b = _seal(core, kit, 4, round_id=2)
    assert _releases(core) == [] and core.stats()["batches_released"] == 0  # sealing is not releasing
    first = list(core.read_batch(a.batch_id))
    assert list(core.read_batch(a.batch_id)) == first  # a second fetch adds no record
    recs = _releases(core)
    assert len(recs) == 1
    assert {k: recs[0][k] for k in ("batch_id", "key_epoch", "round_id", "n")} == {
        "batch_id": a.batch_id.hex(), "key_epoch": kit.key_epoch, "round_id": 1, "n": 5,
    }
    # nothing about clients or positions: exactly these fields
    assert set(recs[0]) == {"type", "batch_id", "key_epoch", "round_id", "n", "released_at"}
    assert core.stats()["batches_released"] == 1
    core.close()
    core = ShufflerCore(kit.core_config(jdir))
    try:
        assert core.stats()["batches_released"] == 1
        assert list(core.read_batch(a.batch_id)) == first
        assert len(_releases(core)) == 1  # still once, after the restart
        list(core.read_batch(b.batch_id))
        assert [r["round_id"] for r in _releases(core)] == [1, 2] and core.stats()["batches_released"] == 2
    finally:
        core.close()


def _fail_next_journal_write(monkeypatch, core: ShufflerCore, err: int) -> None:
    import os as _os

    import shuffledp.shuffler.journal as jmod

    real_write = _os.write

    def write(fd: int, data: bytes) -> int:
        if fd == core.journal._fd:
            raise OSError(err, _os.strerror(err))
        return real_write(fd, data)

    monkeypatch.setattr(jmod.os, "write", write)


@pytest.mark.parametrize(
    ("err", "code", "reason"),
    [(errno.ENOSPC, "resource_exhausted", "disk_full"), (errno.EIO, "unavailable", "journal_write")],
)
def test_nothing_is_released_when_the_release_cannot_be_recorded(
    core: ShufflerCore, kit, monkeypatch, err: int, code: str, reason: str
) -> None:
    sealed = _seal(core, kit, 5, round_id=1)
    size = core.journal.path.stat().st_size
    _fail_next_journal_write(monkeypatch, core, err)
    with pytest.raises(Refused) as info:
        core.read_batch(sealed.batch_id)  # refused before any byte is handed out
    assert (info.value.code, info.value.reason) == (code, reason)
    monkeypatch.undo()
    assert core.journal.path.stat().st_size == size and core.stats()["batches_released"] == 0
    assert core.healthy
    assert len(list(core.read_batch(sealed.batch_id))) == 5  # with the disk back, the fetch works and is recorded
    assert len(_releases(core)) == 1


def test_a_closed_core_releases_nothing(kit, tmp_path: Path) -> None:
    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    sealed = _seal(core, kit, 5, round_id=1)
    core.close()
    with pytest.raises(Refused) as info:
        core.read_batch(sealed.batch_id)
    assert (info.value.code, info.value.reason) == ("unavailable", "shutting_down")


def test_journal_listing_reads_only_and_says_what_was_released(
    kit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    a = _seal(core, kit, 5, round_id=1)
    b = _seal(core, kit, 4, round_id=2)
    list(core.read_batch(b.batch_id))
    # a torn tail, as a crash during an append leaves it: the listing reports it and leaves the file as it is
    with open(core.journal.path, "ab") as fh:
        fh.write(b"SJR1\x00\x00\x01\x00")
    before = core.journal.path.read_bytes()
    try:
        assert main(["shuffler", "journal", "--journal-dir", str(jdir)]) == 0
        out, err = capsys.readouterr()
        rows = [json.loads(line) for line in out.splitlines()]
        assert [(r["batch_id"], r["round_id"], r["n"], r["released"]) for r in rows] == [
            (a.batch_id.hex(), 1, 5, False),
            (b.batch_id.hex(), 2, 4, True),
        ]
        assert rows[0]["released_at"] is None and isinstance(rows[1]["released_at"], int)
        assert rows[1]["statement"] == b.statement.decode() and rows[1]["signature"] == b.signature.hex()
        assert "2 sealed batch(es), 1 released, 4 reports released" in err and "torn tail" in err
        assert core.journal.path.read_bytes() == before  # read only
        assert journal_listing(str(jdir))[1] == len(before) - 8
    finally:
        core.close()


def test_journal_listing_refuses_a_directory_without_a_journal(tmp_path: Path, capsys) -> None:
    assert main(["shuffler", "journal", "--journal-dir", str(tmp_path)]) == 2
    assert "no journal at" in capsys.readouterr().err
    assert not (tmp_path / "journal.log").exists()  # and creates nothing


def test_an_honest_listing_passes_the_audit_across_a_key_rotation(
    kit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``shuffledp shuffler journal`` prints for a real shuffler, set against the ledgers the server would
    write, gives no violation in any scope, with keys or without, across a rotation of the signing key; and the
    same listing with one line's epoch relabelled does (shuffledp.deploy.audit)."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from shuffledp.accounting.bounds import epsilon_for_rounds
    from shuffledp.accounting.events import ShuffleRound
    from shuffledp.accounting.ledger import Ledger
    from shuffledp.deploy.audit_cli import main as audit
    from shuffledp.shuffler.keys import save_public_key

    def seal(core: ShufflerCore, n: int, round_id: int, epoch: int, empty: int = 0):
        b = core.begin(kit.header(n + empty, round_id=round_id, key_epoch=epoch))
        for i in range(n):
            b.add(kit.seal(i, round_id=round_id, key_epoch=epoch))
        for _ in range(empty):
            b.add(b"")  # a placeholder: a counted drop, not charged
        return b.finish()

    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    sealed0 = [seal(core, 4, 1, 0, empty=2), seal(core, 5, 2, 0)]
    seal(core, 3, 2**63 + 5, 0)  # sealed, never released nor charged; a round id beyond SQLite's INTEGER
    for sb in sealed0:
        list(core.read_batch(sb.batch_id))
    core.close()
    sk1 = ed25519.Ed25519PrivateKey.generate()  # the signing key rotates with the key epoch
    core = ShufflerCore(kit.core_config(jdir, key_epoch=1, signing_private_key=sk1.private_bytes_raw()))
    sealed1 = [seal(core, 6, 1, 1, empty=1)]
    list(core.read_batch(sealed1[0].batch_id))
    core.close()

    assert main(["shuffler", "journal", "--journal-dir", str(jdir)]) == 0
    listing = tmp_path / "releases.jsonl"
    listing.write_text(capsys.readouterr().out)
    pk0, pk1 = tmp_path / "epoch0.pub", tmp_path / "epoch1.pub"
    save_public_key(pk0, kit.verify_key, "ed25519")
    save_public_key(pk1, sk1.public_key().public_bytes_raw(), "ed25519")
    ledgers = {}
    for epoch, sealed in ((0, sealed0), (1, sealed1)):
        ledgers[epoch] = tmp_path / f"ledger{epoch}.sqlite"
        with Ledger(ledgers[epoch]) as ledger:
            for i, sb in enumerate(sealed):  # the cumulative epsilon an honest server records (the audit checks it)
                eps = epsilon_for_rounds("clones", [ShuffleRound(n=s.n, eps0=2.0) for s in sealed[: i + 1]], 1e-6)
                ledger.append(round=sb.round_id, n_reports=sb.n, eps0=2.0, mechanism="laplace", delta=1e-6,
                              epsilons={"clones": eps.value}, kinds={"clones": "upper"}, key_epoch=sb.key_epoch,
                              batch_id=sb.batch_id)
    both = ["--ledger", str(ledgers[0]), "--ledger", str(ledgers[1])]
    scopes = [
        both,
        [*both, "--shuffler-verify-key", f"0={pk0}", "--shuffler-verify-key", f"1={pk1}"],
        ["--ledger", str(ledgers[0]), "--key-epoch", "0", "--shuffler-verify-key", str(pk0)],
        ["--ledger", str(ledgers[1]), "--key-epoch", "1", "--shuffler-verify-key", str(pk1)],
        ["--ledger", str(ledgers[1]), "--key-epoch", "1", "--shuffler-verify-key", str(pk1),
         "--shuffler-verify-key", f"0={pk0}"],
    ]
    for extra in scopes:
        code = audit(["audit", "--json", "--releases", str(listing), *extra])
        report = json.loads(capsys.readouterr().out)
        assert (code, report["violations"]) == (0, []), extra
    assert report["reports_released"] == report["reports_charged"] == 6
    # the same listing with epoch 0's round 2 relabelled out of an audit of epoch 0 (its signature left as is)
    lines = [json.loads(line) for line in listing.read_text().splitlines()]
    assert sum(1 for line in lines if (line["key_epoch"], line["round_id"]) == (0, 2)) == 1
    for line in lines:
        if (line["key_epoch"], line["round_id"]) == (0, 2):
            line["key_epoch"] = 9
    listing.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for extra in scopes[2], scopes[2][:4]:  # with epoch 0's key, and with no key at all
        assert audit(["audit", "--json", "--releases", str(listing), *extra]) == 1
        report = json.loads(capsys.readouterr().out)
        assert [v.split(" (")[0] for v in report["violations"]] == ["key epoch 9, round 2"], extra
        assert "names (batch, epoch, round, n)" in report["violations"][0]


def test_stats_count_the_served_epochs_releases_from_the_journal(kit, tmp_path: Path) -> None:
    """``epoch_batches_released`` (what a server checks before a fresh run) counts the journal's releases of the
    served key epoch, those of earlier processes included, and no other epoch's."""
    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    released, _ = _seal(core, kit, 4, round_id=1), _seal(core, kit, 4, round_id=2)  # round 2: never released
    list(core.read_batch(released.batch_id))
    assert {k: core.stats()[k] for k in ("key_epoch", "epoch_batches_released", "batches_sealed")} == \
        {"key_epoch": 0, "epoch_batches_released": 1, "batches_sealed": 2}
    core.close()
    for epoch, expected in ((1, 0), (0, 1)):  # after a restart: another epoch, then the same one again
        core = ShufflerCore(kit.core_config(jdir, key_epoch=epoch))
        try:
            assert (core.stats()["key_epoch"], core.stats()["epoch_batches_released"]) == (epoch, expected)
        finally:
            core.close()
