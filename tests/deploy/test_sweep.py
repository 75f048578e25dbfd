"""``shuffledp sweep``: a tiny grid writes one table (CSV and markdown) with one row per (mechanism, eps0, rounds) and
one figure; bad arguments exit 2 with a message saying what is allowed."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from shuffledp.deploy.cli import main as shuffledp_main
from shuffledp.deploy.sweep import COLUMNS

TINY = ["--dataset", "digits", "--num-clients", "120", "--pca", "5", "--rounds", "2", "--seeds", "1"]


def test_a_tiny_sweep_writes_the_table_and_the_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    code = shuffledp_main(["sweep", "--mechanisms", "laplace,duchi", "--eps0", "2,8", "--server-lr", "1,5",
                           *TINY, "--out", str(out)])
    assert code == 0
    with (out / "sweep.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [tuple(r[c] for c in ("mechanism", "budget", "budget_value", "rounds")) for r in table] == [
        ("laplace", "eps0", "2.0", "2"), ("laplace", "eps0", "8.0", "2"),
        ("duchi", "eps0", "2.0", "2"), ("duchi", "eps0", "8.0", "2")]
    assert list(table[0]) == list(COLUMNS)
    for r in table:
        assert 0.0 <= float(r["test_min"]) <= float(r["test_mean"]) <= float(r["test_max"]) <= 1.0
        assert r["server_lr"] in ("1.0", "5.0") and r["seeds"] == "1"
        # auto: each mechanism's rigorous default, as in the apps
        assert r["family"] == {"laplace": "blanket-laplace", "duchi": "blanket-duchi"}[r["mechanism"]]
    eps = {r["budget_value"]: float(r["epsilon"]) for r in table}
    assert eps["2.0"] < eps["8.0"]  # the cumulative epsilon grows with eps0
    md = (out / "sweep.md").read_text()
    assert md.count("| laplace | eps0 |") == 2 and md.count("| duchi | eps0 |") == 2
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "[8/8]" in printed and "| duchi | eps0 |" in printed  # progress per run, then the table


@pytest.mark.parametrize(("argv", "message"), [
    (["--mechanisms", "laplace,gaussian", "--eps0", "2"], "must be one of laplace, duchi, privunit2"),
    (["--eps0", "2", "--target-epsilon", "4"], "not allowed with argument"),
    (["--rounds", "2"], "one of the arguments --eps0 --target-epsilon is required"),
    (["--eps0", "2,x"], "--eps0 must be a comma-separated list of floats"),
    (["--eps0", "0"], "--eps0 values must be in (0, 64]"),
    (["--eps0", "2", "--rounds", "0"], "--rounds values must be ints >= 1"),
    (["--eps0", "2", "--dataset", "cifar"], "--dataset must be one of digits"),
    (["--eps0", "2", "--family", "magic"], "--family must be 'auto' or one of clones"),
    (["--eps0", "2", "--mechanisms", "laplace,duchi", "--family", "blanket-laplace"],
     "holds only for reports of the 'laplace' mechanism"),
    (["--target-epsilon", "0.001", "--num-clients", "50"], "cannot be met in 10 rounds of 50 reports"),
])
def test_bad_arguments_exit_2_saying_what_is_allowed(argv: list[str], message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert shuffledp_main(["sweep", *argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
