"""The ledger refuses nonsense: a cumulative epsilon that falls, a default family that is not an upper bound, a
write into a damaged file, and an empty file taken for a new ledger."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from shuffledp.accounting.ledger import Ledger, LedgerError


def _append(ledger: Ledger, rnd: int, eps: float, *, kind: str = "upper", delta: float = 1e-6) -> None:
    ledger.append(round=rnd, n_reports=100, eps0=1.0, mechanism="laplace", delta=delta, epsilons={"clones": eps},
                  kinds={"clones": kind})


def test_a_falling_cumulative_epsilon_is_refused(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        _append(ledger, 1, 0.206)
        with pytest.raises(LedgerError, match=r"would fall from 0.206 \(round 1\) to 0.001 at the same delta"):
            _append(ledger, 2, 0.001)
        assert [r["round"] for r in ledger.rows()] == [1]  # nothing written
        _append(ledger, 2, 0.3)
        _append(ledger, 3, 0.2, delta=1e-3)  # another delta: a smaller epsilon is not a contradiction


@pytest.mark.parametrize("kind", ["approximate", "lower"])
def test_the_default_family_must_be_an_upper_bound(tmp_path: Path, kind: str) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        with pytest.raises(LedgerError, match=f"default family 'clones' is labelled '{kind}'.*must be 'upper'"):
            _append(ledger, 1, 0.5, kind=kind)


def _damage(path: Path, table: str, offset: int) -> None:
    """Overwrite part of ``table``'s root b-tree page (the ledger is closed: its WAL is checkpointed)."""
    conn = sqlite3.connect(path)
    page = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(path, "r+b") as fh:
        fh.seek((page - 1) * size + offset)
        fh.write(b"\xff" * 64)


@pytest.mark.parametrize("table, offset", [("epsilons", 8), ("rounds", 0)])
def test_a_damaged_ledger_is_not_written(tmp_path: Path, table: str, offset: int) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        for rnd in (1, 2):
            _append(ledger, rnd, 0.1 * rnd)
    _damage(path, table, offset)
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="damaged|cannot be written|not a readable"):
        with Ledger(path) as ledger:
            _append(ledger, 3, 0.3)
    assert path.read_bytes() == before


def test_an_empty_file_is_not_taken_for_a_new_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"")
    with pytest.raises(LedgerError, match=r"exists but is empty \(0 bytes\)"):
        Ledger(path)
    assert path.read_bytes() == b""
    with Ledger(tmp_path / "new.sqlite") as ledger:  # a ledger that does not exist yet is still created
        _append(ledger, 1, 0.1)


def test_a_mechanism_aware_default_family_only_charges_its_own_randomizers_rounds(tmp_path: Path) -> None:
    """blanket-laplace bounds the project's discrete Laplace randomizer only: a round whose reports came from
    another mechanism cannot be charged with it, and nothing is written."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ok = "discrete-laplace-l1(d=650,C=1,eps0=4,report=gradient)"
        ledger.append(round=1, n_reports=100, eps0=4.0, mechanism=ok, delta=1e-6,
                      epsilons={"blanket-laplace": 1.0}, kinds={"blanket-laplace": "upper"},
                      default_family="blanket-laplace")
        with pytest.raises(LedgerError, match="bounds only reports of the 'laplace' randomizer"):
            ledger.append(round=2, n_reports=100, eps0=4.0, mechanism="duchi-l2(d=650,C=0.5,eps0=4,report=gradient)",
                          delta=1e-6, epsilons={"blanket-laplace": 1.5}, kinds={"blanket-laplace": "upper"},
                          default_family="blanket-laplace")
        assert [r["round"] for r in ledger.rows()] == [1]


def test_blanket_duchi_only_charges_rounds_of_the_duchi_mechanism(tmp_path: Path) -> None:
    """blanket-duchi bounds the project's Duchi et al. mechanism only: a discrete Laplace round is refused, and the
    refusal names a family that holds for any randomizer."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.append(round=1, n_reports=100, eps0=2.0, mechanism="duchi-l2(d=650,C=0.5,eps0=2,report=gradient)",
                      delta=1e-6, epsilons={"blanket-duchi": 1.0}, kinds={"blanket-duchi": "upper"},
                      default_family="blanket-duchi")
        with pytest.raises(LedgerError, match="bounds only reports of the 'duchi' randomizer.*such as clones-focs"):
            ledger.append(round=2, n_reports=100, eps0=2.0, mechanism="discrete-laplace-l1(d=650,C=1,eps0=2)",
                          delta=1e-6, epsilons={"blanket-duchi": 1.5}, kinds={"blanket-duchi": "upper"},
                          default_family="blanket-duchi")
        assert [r["round"] for r in ledger.rows()] == [1]
