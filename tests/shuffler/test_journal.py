"""Journal: durability format, torn-tail recovery, corruption detection, orphan cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest

from shuffledp.shuffler.journal import Journal, JournalCorrupt


def _fill(d: Path, n: int) -> list[int]:
    j = Journal(d)
    sizes = []
    for i in range(n):
        j.append({"type": "note", "i": i, "pad": "x" * (10 * i)})
        sizes.append(j.path.stat().st_size)
    j.close()
    return sizes


def test_records_round_trip(tmp_path: Path) -> None:
    _fill(tmp_path, 3)
    j = Journal(tmp_path)
    assert [r["i"] for r in j.records] == [0, 1, 2] and j.torn_bytes == 0
    j.close()


@pytest.mark.parametrize("cut", [1, 4, 20, 39, 40, 41, 60])
def test_torn_tail_is_ignored_and_truncated(tmp_path: Path, cut: int) -> None:
    sizes = _fill(tmp_path, 3)
    path = tmp_path / "journal.log"
    data = path.read_bytes()
    # a fourth record whose append was interrupted after `cut` bytes
    j = Journal(tmp_path)
    j.append({"type": "note", "i": 3, "pad": "y" * 50})
    j.close()
    full = path.read_bytes()
    path.write_bytes(full[: sizes[-1] + min(cut, len(full) - sizes[-1] - 1)])
    j = Journal(tmp_path)
    assert [r["i"] for r in j.records] == [0, 1, 2]
    assert j.torn_bytes > 0 and path.read_bytes() == data
    j.append({"type": "note", "i": 4})  # appending after recovery yields a clean journal
    j.close()
    assert [r["i"] for r in Journal(tmp_path).records] == [0, 1, 2, 4]


def test_zero_filled_tail_is_torn(tmp_path: Path) -> None:
    _fill(tmp_path, 2)
    path = tmp_path / "journal.log"
    with open(path, "ab") as fh:
        fh.write(b"\0" * 4096)
    j = Journal(tmp_path)
    assert len(j.records) == 2 and j.torn_bytes == 4096


def test_checksum_failure_in_a_complete_last_record_is_corruption(tmp_path: Path) -> None:
    """Only a physically incomplete record is a torn tail; a complete one that fails its checksum is damage."""
    _fill(tmp_path, 3)
    path = tmp_path / "journal.log"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="checksum mismatch in the complete record"):
        Journal(tmp_path)
    assert path.read_bytes() == bytes(data)  # nothing was cut


def test_damage_before_the_end_is_corruption(tmp_path: Path) -> None:
    sizes = _fill(tmp_path, 3)
    path = tmp_path / "journal.log"
    data = bytearray(path.read_bytes())
    data[sizes[0] + 45] ^= 0xFF  # inside record 1's body, record 2 follows
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="further data"):
        Journal(tmp_path)


def test_orphans_are_quarantined_and_staging_is_removed(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.append({"type": "batch", "output": "kept.out"})
    (j.batches_dir / "kept.out").write_bytes(b"x")
    (j.batches_dir / "orphan.out").write_bytes(b"y")
    (j.batches_dir / ".tmp.out.tmp").write_bytes(b"z")
    (j.staging_dir / "a.stage").write_bytes(b"s")
    j.close()
    j = Journal(tmp_path)
    assert sorted(p.name for p in j.batches_dir.iterdir()) == ["kept.out"]
    assert list(j.staging_dir.iterdir()) == []
    kept = sorted(p.read_bytes() for p in j.quarantine_dir.iterdir())  # moved aside, never deleted
    assert kept == [b"y", b"z"] and len(j.quarantined) == 2


def test_failed_append_is_rolled_back_and_nothing_is_committed_later(tmp_path: Path, monkeypatch) -> None:
    import errno

    import shuffledp.shuffler.journal as jmod
    from shuffledp.shuffler.journal import JournalFailed, JournalWriteError

    _fill(tmp_path, 2)
    j = Journal(tmp_path)
    size = j.path.stat().st_size
    real_write = jmod.os.write

    def short_then_full(fd: int, data: bytes) -> int:
        if len(data) > 10:
            return real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jmod.os, "write", short_then_full)
    with pytest.raises(JournalWriteError) as info:
        j.append({"i": 99})
    assert info.value.errno == errno.ENOSPC and j.path.stat().st_size == size and not j.failed
    monkeypatch.setattr(jmod.os, "write", real_write)
    j.append({"i": 2})
    j.close()
    assert [r["i"] for r in Journal(tmp_path).records] == [0, 1, 2]  # 99 was never committed
    j = Journal(tmp_path)
    monkeypatch.setattr(jmod.os, "write", short_then_full)
    monkeypatch.setattr(jmod.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(JournalFailed):
        j.append({"i": 3})
    monkeypatch.undo()
    assert j.failed
    with pytest.raises(JournalFailed, match="refuses further appends"):
        j.append({"i": 4})
    j.close()


def test_write_file_durably_replaces_with_mode_and_fsyncs_the_directory(tmp_path: Path, monkeypatch) -> None:
    import os
    import stat

    import shuffledp.shuffler.journal as journal

    synced: list[Path] = []
    real = journal.fsync_dir
    monkeypatch.setattr(journal, "fsync_dir", lambda d: (synced.append(Path(d)), real(d)))
    target = tmp_path / "sub" / "file.bin"
    journal.write_file_durably(target, b"old", mode=0o640)
    journal.write_file_durably(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert synced == [target.parent, target.parent]
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]  # no temporary file left


def test_write_file_durably_without_overwrite_never_replaces_a_file_that_appears_meanwhile(
    tmp_path: Path, monkeypatch
) -> None:
    """overwrite=False links the finished temporary file into place, so a file that another writer created
    after any check (here: right after the temporary file was made) is kept, and the call fails."""
    import tempfile

    import shuffledp.shuffler.journal as journal

    target = tmp_path / "key.pem"
    real_mkstemp = tempfile.mkstemp

    def racing_mkstemp(*args, **kwargs):
        made = real_mkstemp(*args, **kwargs)
        target.write_bytes(b"the other writer's key")
        return made

    monkeypatch.setattr(journal.tempfile, "mkstemp", racing_mkstemp)
    with pytest.raises(FileExistsError):
        journal.write_file_durably(target, b"mine", overwrite=False)
    assert target.read_bytes() == b"the other writer's key"
    assert [p.name for p in tmp_path.iterdir()] == ["key.pem"]


def test_write_file_durably_without_hard_links_still_never_replaces(tmp_path: Path, monkeypatch) -> None:
    """On a filesystem without hard links (link fails EPERM, as on vfat) overwrite=False creates the file
    exclusively instead: it is written with its mode, an existing file is kept, and no temporary file remains."""
    import errno
    import os
    import stat

    import shuffledp.shuffler.journal as journal

    def no_link(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", src, None, dst)

    monkeypatch.setattr(journal.os, "link", no_link)
    target = tmp_path / "k.pem"
    journal.write_file_durably(target, b"secret", mode=0o600, overwrite=False)
    assert target.read_bytes() == b"secret" and stat.S_IMODE(os.stat(target).st_mode) == 0o600
    with pytest.raises(FileExistsError) as exc:
        journal.write_file_durably(target, b"other", mode=0o600, overwrite=False)
    assert exc.value.filename == str(target)
    assert target.read_bytes() == b"secret"
    assert [p.name for p in tmp_path.iterdir()] == ["k.pem"]


def test_write_file_durably_tolerates_a_filesystem_that_cannot_sync_directories(tmp_path: Path, monkeypatch) -> None:
    import errno

    import shuffledp.shuffler.journal as journal

    def einval(_d):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(journal, "fsync_dir", einval)
    journal.write_file_durably(tmp_path / "a", b"x")
    assert (tmp_path / "a").read_bytes() == b"x"

    def eio(_d):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal, "fsync_dir", eio)
    with pytest.raises(OSError) as exc:  # a real I/O error is not swallowed
        journal.write_file_durably(tmp_path / "b", b"y")
    assert exc.value.errno == errno.EIO


def test_a_damaged_length_that_reaches_past_later_records_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    # A flipped high bit in the first record's length looks like a torn tail; cutting there would erase the whole
    # journal (every binding, replay tag and release record) and start healthy.
    sizes = _fill(tmp_path, 3)
    path = tmp_path / "journal.log"
    data = bytearray(path.read_bytes())
    data[4] |= 0x08  # body_length (u32, big-endian, at bytes 4..7) += 2**27: past the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="at byte 0 and it is not a torn tail"):
        Journal(tmp_path)
    assert path.read_bytes() == bytes(data)  # evidence kept
    # the same damage in the *last* record cannot be told from an interrupted append: cut, as before
    data = bytearray(path.read_bytes())
    data[4] &= ~0x08
    data[sizes[1] + 4] |= 0x08
    path.write_bytes(bytes(data))
    j = Journal(tmp_path)
    assert [r["i"] for r in j.records] == [0, 1] and j.torn_bytes == sizes[2] - sizes[1]
    j.close()


def test_lost_records_beside_sealed_outputs_refuse_the_start(tmp_path: Path) -> None:
    # A missing journal, or one cut at a record boundary, must not look like a clean start: every sealed output
    # would be quarantined and the bindings, replay cache and release records forgotten.
    j = Journal(tmp_path)
    for name in ("a", "b"):
        j.append({"type": "batch", "output": f"{name}.out"})
        (j.batches_dir / f"{name}.out").write_bytes(b"sealed")
    j.close()
    data = j.path.read_bytes()
    j.path.unlink()
    with pytest.raises(JournalCorrupt, match="journal.log is missing but .* holds 2 sealed output"):
        Journal(tmp_path)
    j.path.write_bytes(b"")  # cut at a record boundary: both outputs lack their record
    with pytest.raises(JournalCorrupt, match="holds 2 sealed outputs without a commit record"):
        Journal(tmp_path)
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == ["a.out", "b.out"]  # nothing moved
    first = len(data) // 2  # the two records have the same size: keep the first, lose the second
    j.path.write_bytes(data[:first])
    j = Journal(tmp_path)  # one output without its record is what a crash between rename and append leaves
    assert [r["output"] for r in j.records] == ["a.out"] and len(j.quarantined) == 1
    j.close()
