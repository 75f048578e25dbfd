"""The ``shuffledp account`` / ``shuffledp ledger`` contract, run as real subprocesses.

Exit 0 with exactly one JSON object on stdout under ``--json``; exit 2 with the reason on stderr and nothing on
stdout for invalid or refused parameters. A few error cases are also driven in-process through
``shuffledp.accounting.cli.main`` to keep the suite fast.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shuffledp.accounting import FAMILIES, bounds
from shuffledp.accounting.cli import main
from shuffledp.accounting.ledger import Ledger

EXPECTED_FAMILIES = (
    "clones", "clones-focs", "ccg-gdp", "ccg-rdp", "girgis", "fmt", "rr-lower", "canonical-gdp", "no-shuffle",
    "blanket-laplace", "blanket-privunit2", "blanket-duchi",
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m shuffledp.deploy.cli ARGS`` (the ``shuffledp`` entry point) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "shuffledp.deploy.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


def ok_json(*args: str) -> dict[str, object]:
    proc = run(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one JSON line, got {proc.stdout!r}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def ok_json_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    """Like :func:`ok_json`, through ``shuffledp.accounting.cli.main`` in this process (no interpreter start-up)."""
    code = main([*args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one JSON line, got {captured.out!r}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def test_the_families_of_the_contract() -> None:
    assert tuple(FAMILIES) == EXPECTED_FAMILIES


def test_epsilon_json_contract() -> None:
    obj = ok_json("account", "epsilon", "--eps0", "2", "--n", "10000", "--delta", "1e-6")
    assert set(obj) == {"quantity", "value", "kind", "bound", "eps0", "n", "delta", "rounds"}
    assert obj["quantity"] == "epsilon" and obj["kind"] == "upper" and obj["bound"] == "clones"
    assert obj["eps0"] == 2.0 and obj["n"] == 10000 and obj["delta"] == 1e-6 and obj["rounds"] == 1
    assert isinstance(obj["value"], float)
    assert obj["value"] == pytest.approx(0.1143996153, rel=1e-6)  # reference: exact stronger-clone value
    assert obj["value"] == bounds.epsilon("clones", 2.0, 10000, 1e-6, 1).value


def test_epsilon_with_bound_rounds_and_scientific_n(capsys: pytest.CaptureFixture[str]) -> None:
    obj = ok_json_in_process(capsys, "account", "epsilon", "--eps0", "1", "--n", "1e4", "--delta", "1e-6",
                             "--rounds", "10", "--bound", "clones-focs")
    assert obj["bound"] == "clones-focs" and obj["rounds"] == 10 and obj["n"] == 10000
    assert obj["value"] == bounds.epsilon("clones-focs", 1.0, 10000, 1e-6, 10).value


def test_epsilon_table_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["account", "epsilon", "--eps0", "2", "--n", "10000", "--delta", "1e-6"]) == 0
    out = capsys.readouterr().out
    value = bounds.epsilon("clones", 2.0, 10000, 1e-6, 1).value
    assert "upper" in out and f"{value:.10g}" in out and "clones" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_delta_renyi_and_calibrate_json_contracts(capsys: pytest.CaptureFixture[str]) -> None:
    obj = ok_json("account", "delta", "--eps0", "2", "--n", "10000", "--epsilon", "0.1")
    assert set(obj) == {"quantity", "value", "kind", "bound", "eps0", "n", "epsilon", "rounds"}
    assert obj["quantity"] == "delta" and obj["epsilon"] == 0.1 and obj["kind"] == "upper"
    assert obj["value"] == pytest.approx(6.021292672e-06, rel=1e-6)  # reference value

    obj = ok_json_in_process(capsys, "account", "renyi", "--eps0", "1", "--n", "10000", "--order", "2")
    assert set(obj) == {"quantity", "value", "kind", "bound", "eps0", "n", "order", "rounds"}
    assert obj["quantity"] == "renyi" and obj["order"] == 2.0
    assert obj["value"] == pytest.approx(1.588158093e-4, rel=1e-6)  # reference value

    obj = ok_json_in_process(capsys, "account", "calibrate", "--target-epsilon", "1", "--delta", "1e-6",
                             "--n", "10000", "--rounds", "1")
    assert set(obj) == {"quantity", "value", "kind", "meaning", "bound", "target_epsilon", "delta", "n", "rounds",
                        "achieved_epsilon", "first_failing_eps0"}
    assert obj["quantity"] == "eps0" and obj["target_epsilon"] == 1.0 and obj["rounds"] == 1
    assert obj["kind"] == "upper" and obj["bound"] == "clones" and obj["meaning"].startswith("certified")
    eps0 = obj["value"]
    assert isinstance(eps0, float) and eps0 > 1.0  # amplification: n = 1e4 reports allow eps0 well above 1
    achieved = bounds.epsilon("clones", eps0, 10000, 1e-6, 1).value
    assert achieved <= 1.0 and obj["achieved_epsilon"] == achieved  # calibrated eps0 respects the target
    assert bounds.epsilon("clones", obj["first_failing_eps0"], 10000, 1e-6, 1).value > 1.0
    # a search that stops at the top of its eps0 range says so (it printed 20.0 with no flag)
    obj = ok_json_in_process(capsys, "account", "calibrate", "--target-epsilon", "30", "--delta", "1e-6",
                             "--n", "100", "--rounds", "1")
    assert obj["range_upper_end_reached"] is True and obj["achieved_epsilon"] <= 30.0

    obj = ok_json_in_process(capsys, "account", "calibrate", "--target-epsilon", "0.5", "--delta", "1e-6",
                             "--n", "10000", "--rounds", "2", "--bound", "ccg-gdp")
    assert obj["bound"] == "ccg-gdp" and obj["kind"] == "approximate" and obj["rounds"] == 2
    assert obj["meaning"].startswith("estimate")
    # a calibrated eps0 from a lower bound is a limit, not "the true loss is at least this"
    code = main(["account", "calibrate", "--target-epsilon", "1", "--delta", "1e-6", "--n", "10000", "--rounds", "1",
                 "--bound", "rr-lower"])
    out = capsys.readouterr().out
    assert code == 0 and "lower: limit, not certified: a lower bound on epsilon exceeds the target above this" in out
    assert "true loss is at least this" not in out


def test_clt_refusal_and_allow_approximate(capsys: pytest.CaptureFixture[str]) -> None:
    # n/(e^eps0+1) = 1e4/(e^8+1) ~ 3.4 expected clones < 2 ln(1/delta) ~ 27.6 -> refused
    args = ("account", "epsilon", "--eps0", "8", "--n", "10000", "--delta", "1e-6", "--bound", "ccg-gdp", "--json")
    proc = run(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "refused" in proc.stderr and proc.stderr.strip()
    obj = ok_json_in_process(capsys, *args[:-1], "--allow-approximate")
    assert obj["kind"] == "approximate" and obj["bound"] == "ccg-gdp"


def test_fmt_outside_its_validity_region_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # log(n / (16 log(4/delta))) = log(1000 / (16 log 4e6)) ~ 1.4 < eps0 = 4
    assert main(["account", "epsilon", "--eps0", "4", "--n", "1000", "--delta", "1e-6", "--bound", "fmt",
                 "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "refused" in captured.err and "fmt" in captured.err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--eps0", "-1", "--n", "100", "--delta", "1e-6"), "--eps0"),
        (("--eps0", "nan", "--n", "100", "--delta", "1e-6"), "--eps0"),
        (("--eps0", "1", "--n", "0", "--delta", "1e-6"), "--n"),
        (("--eps0", "1", "--n", "1.5", "--delta", "1e-6"), "--n"),
        (("--eps0", "1", "--n", "100", "--delta", "1"), "--delta"),
        (("--eps0", "1", "--n", "100"), "--delta"),
        (("--eps0", "1", "--n", "100", "--delta", "1e-6", "--bound", "nope"), "--bound"),
        (("--eps0", "1", "--n", "100", "--delta", "1e-6", "--rounds", "0"), "--rounds"),
        (("--eps0", "1", "--n", "100", "--delta", "1e-6", "--unknown"), "unrecognized"),
    ],
)
def test_invalid_parameters_exit_2_in_process(
    args: tuple[str, ...], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["account", "epsilon", *args, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and needle in captured.err


def test_invalid_parameters_exit_2_through_the_dispatcher() -> None:
    proc = run("account", "renyi", "--eps0", "1", "--n", "100", "--order", "1", "--json")
    assert proc.returncode == 2 and proc.stdout == "" and "--order" in proc.stderr
    proc = run("account", "frobnicate")
    assert proc.returncode == 2 and proc.stdout == "" and "frobnicate" in proc.stderr


def test_compare_lists_every_family_and_never_a_number_for_a_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    obj = ok_json_in_process(capsys, "account", "compare", "--eps0", "8", "--n", "10000", "--delta", "1e-6")
    assert obj["quantity"] == "epsilon" and obj["n"] == 10000
    results = obj["results"]
    assert [r["bound"] for r in results] == list(EXPECTED_FAMILIES)
    by_family = {r["bound"]: r for r in results}
    assert by_family["ccg-gdp"]["kind"] == "refused" and by_family["ccg-gdp"]["value"] is None
    assert by_family["ccg-gdp"]["reason"]
    assert by_family["clones"]["kind"] == "upper"
    assert by_family["clones"]["value"] == bounds.epsilon("clones", 8.0, 10000, 1e-6).value
    for r in results:
        assert (r["value"] is None) == (r["kind"] == "refused")
        if r["kind"] == "upper" and "holds_only_for" not in r:  # generic families only (docs/accounting.md)
            assert r["value"] >= by_family["rr-lower"]["value"] * (1 - 1e-9)


def test_compare_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["account", "compare", "--eps0", "2", "--n", "10000", "--delta", "1e-6", "--bound", "clones",
                 "--bound", "rr-lower"]) == 0
    out = capsys.readouterr().out
    assert "clones" in out and "rr-lower" in out and "guarantee" in out and "lower bound" in out
    assert "ccg-gdp" not in out


def test_compare_says_when_a_value_is_the_no_shuffle_cap(capsys: pytest.CaptureFixture[str]) -> None:
    # clones at delta 1e-16 over 2 rounds is capped (its PLD carries 1e-15 of truncated mass at infinity); the
    # compare table printed "clones 2 upper guarantee" with nothing to say it was not the family's own value
    args = ["account", "compare", "--eps0", "1", "--n", "10000", "--delta", "1e-16", "--rounds", "2", "--bound",
            "clones"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "capped, see [1]" in out and "no-shuffle value" in out
    (row,) = ok_json_in_process(capsys, *args)["results"]
    assert row["capped_by_no_shuffle"] is True
    assert row["value"] == bounds.epsilon("no-shuffle", 1.0, 10000, 1e-16, 2).value


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eps.png"
    obj = ok_json_in_process(capsys, "account", "plot", "--eps0", "1", "--n", "10000", "--delta", "1e-6",
                             "--max-rounds", "10", "--points", "3", "--bound", "clones", "--bound", "rr-lower",
                             "--out", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = {s["bound"]: s for s in obj["series"]}
    assert set(series) == {"clones", "rr-lower"}
    xs = [p[0] for p in series["clones"]["points"]]
    assert xs[0] == 1 and xs[-1] == 10
    values = [p[1] for p in series["clones"]["points"]]
    assert all(b > a for a, b in zip(values, values[1:]))
    assert values[-1] == bounds.epsilon("clones", 1.0, 10000, 1e-6, 10).value


def test_plot_versus_n_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "n.png"
    code = main(["account", "plot", "--x", "n", "--eps0", "4", "--delta", "1e-6", "--n-min", "1000",
                 "--n-max", "100000", "--points", "3", "--bound", "fmt", "--bound", "clones", "--out", str(out)])
    assert code == 0 and out.stat().st_size > 0
    text = capsys.readouterr().out
    assert "fmt" in text and "refused" in text  # fmt is outside its region at n = 1000, eps0 = 4


def _ledger(path: Path) -> None:
    with Ledger(path) as ledger:
        for rnd in (1, 2):
            ledger.append(
                round=rnd, n_reports=10_000, eps0=1.0, mechanism="binary-rr", delta=1e-6,
                epsilons={"clones": 0.1 * rnd, "ccg-gdp": None}, kinds={"clones": "upper", "ccg-gdp": "refused"},
                reasons={"ccg-gdp": "a reason"},
            )


def test_ledger_show_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ledger.db"
    _ledger(path)
    obj = ok_json("ledger", "show", str(path))
    assert [r["round"] for r in obj["rows"]] == [1, 2]
    assert obj["rows"][1]["epsilons"]["clones"]["value"] == 0.2
    assert main(["ledger", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "binary-rr" in out and "refused" in out and "0.2" in out
    proc = run("ledger", "export", str(path), "--format", "json", "--out", str(tmp_path / "export.json"))
    assert proc.returncode == 0, proc.stderr
    assert main(["ledger", "export", str(path), "--format", "csv", "--out", str(tmp_path / "export.csv")]) == 0
    assert json.loads((tmp_path / "export.json").read_text())["rows"] == obj["rows"]
    assert (tmp_path / "export.csv").read_text().splitlines()[0].startswith("round,time,n_reports,eps0")


def test_ledger_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.db"
    assert main(["ledger", "show", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "does not exist" in captured.err
    assert not missing.exists()
    assert main(["ledger", "export", str(missing), "--format", "xml", "--out", str(tmp_path / "x")]) == 2
    assert "--format" in capsys.readouterr().err


def test_account_imports_no_torch_flwr_grpc_or_matplotlib() -> None:
    code = (
        "import sys\n"
        "from shuffledp.deploy.cli import main\n"
        "rc = main(['account', 'compare', '--eps0', '1', '--n', '1000', '--delta', '1e-6', '--json'])\n"
        "assert rc == 0, rc\n"
        "bad = [m for m in ('torch', 'flwr', 'grpc', 'matplotlib') if m in sys.modules]\n"
        "print('BAD', bad, file=sys.stderr)\n"
        "raise SystemExit(3 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert math.isfinite(json.loads(proc.stdout)["results"][0]["value"])


def test_calibrate_at_huge_composed_losses_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    # eps0 up to 20 over 1000 rounds: the PLD re-check must not raise ArithmeticError (the CLI would exit 1).
    args = ("account", "calibrate", "--target-epsilon", "5", "--delta", "1e-6", "--n", "100", "--rounds", "1000")
    obj = ok_json_in_process(capsys, *args)
    assert obj["quantity"] == "eps0" and 0.0 < obj["value"] < 20.0


@pytest.mark.parametrize("exc", [ArithmeticError("PLD re-check failed"), RuntimeError("did not converge"),
                                 OverflowError("math range error")])
def test_numerical_failures_exit_2_with_the_reason(
    exc: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(bounds, "epsilon", boom)
    code = main(["account", "epsilon", "--eps0", "1", "--n", "100", "--delta", "1e-6", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert str(exc) in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "args",
    [
        ("renyi", "--eps0", "4", "--n", "100000", "--order", "300"),  # pmf underflow -> log(0) warning
        ("renyi", "--eps0", "60", "--n", "2", "--order", "300"),  # log1p(-1) at large eps0
        ("delta", "--eps0", "60", "--n", "2", "--epsilon", "0.5"),
        ("renyi", "--eps0", "6", "--n", "10000", "--order", "256", "--bound", "rr-lower"),  # overflow must not give NaN
    ],
)
def test_extreme_parameters_leak_no_runtime_warning(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        obj = ok_json_in_process(capsys, "account", *args)
    assert math.isfinite(obj["value"])


def test_a_value_replaced_by_the_no_shuffle_cap_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """At delta below the clone PLD's truncation mass, clones' own epsilon is infinite and the no-shuffle cap
    (T eps0) is reported: still an upper bound, but the output must say it is the cap, not clones' value."""
    capped = ok_json_in_process(capsys, "account", "epsilon", "--eps0", "1", "--n", "1e4", "--delta", "1e-16",
                                "--rounds", "2")
    assert capped["kind"] == "upper" and capped["value"] == pytest.approx(2.0)
    assert capped["capped_by_no_shuffle"] is True and capped["uncapped"] == "inf"
    plain = ok_json_in_process(capsys, "account", "epsilon", "--eps0", "1", "--n", "1e4", "--delta", "1e-6",
                               "--rounds", "2")
    assert "capped_by_no_shuffle" not in plain and plain["value"] < 0.1


def test_n_beyond_the_documented_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[1, 1e\+09\]"):
        bounds.epsilon("girgis", 1.0, 10**15, 1e-6)


def test_tables_round_bounds_outward(capsys: pytest.CaptureFixture[str]) -> None:
    # printed to nearest, an upper bound could print below itself (0.14861004244 as
    # 0.1486100424); a calibrated eps0 from an upper bound rounds down (the safe side).
    from shuffledp.accounting import format_bound

    exact = bounds.epsilon("clones", 1.0, 100_000, 1e-6, 100).value
    assert main(["account", "epsilon", "--eps0", "1", "--n", "100000", "--delta", "1e-6", "--rounds", "100"]) == 0
    printed = capsys.readouterr().out
    value = next(line.split()[1] for line in printed.splitlines() if line.startswith("value"))
    assert float(value) >= exact and value == format_bound(exact, "upper")
    assert main(["account", "compare", "--eps0", "1", "--n", "100000", "--delta", "1e-6", "--rounds", "100"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert float(rows["clones"][1]) >= exact and float(rows["rr-lower"][1]) <= bounds.epsilon(
        "rr-lower", 1.0, 100_000, 1e-6, 100).value
    assert main(["account", "calibrate", "--target-epsilon", "1", "--delta", "1e-6", "--n", "10000",
                 "--rounds", "1"]) == 0
    value = next(line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("value"))
    assert float(value) <= bounds.calibrate("clones", 1.0, 1e-6, 10_000, 1).value
    assert format_bound(0.14861004244, "upper", significant=6) == "0.148611"
    assert format_bound(0.14861004244, "lower", significant=6) == "0.14861"


def test_format_bound_edges() -> None:
    # huge values with decimals, negative zero, a checked digit count.
    from shuffledp.accounting import format_bound

    assert format_bound(-0.0, "upper", decimals=4) == "0.0000"
    assert format_bound(1e300, "upper", decimals=2).startswith("1000000000000000052504760255204420248704")
    assert format_bound(1e300, "upper", decimals=2).endswith(".00")
    assert format_bound(2.5e-7, "upper", significant=6) == "2.5e-07"
    assert format_bound(float("inf"), "upper") == "inf"
    for bad in ({"significant": 0}, {"significant": 16}, {"decimals": -1}, {"significant": 3, "decimals": 2}):
        with pytest.raises(ValueError):
            format_bound(1.0, "upper", **bad)


def test_refusals_name_the_cli_flag_not_the_python_argument(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["account", "epsilon", "--eps0", "8", "--n", "10000", "--delta", "1e-6", "--bound", "ccg-gdp"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--allow-approximate" in err and "allow_approximate" not in err
    for extra in ([], ["--json"]):  # a refused family in compare, in the table and in the JSON reasons
        assert main(["account", "compare", "--eps0", "8", "--n", "10000", "--delta", "1e-6", *extra]) == 0
        out = capsys.readouterr().out
        assert "--allow-approximate" in out and "allow_approximate" not in out


def test_plot_refusals_name_the_cli_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["account", "plot", "--x", "n", "--eps0", "8", "--delta", "1e-6", "--n-min", "1000", "--n-max", "10000",
            "--points", "2", "--bound", "ccg-gdp", "--bound", "clones", "--out", str(tmp_path / "p.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--allow-approximate" in out and "allow_approximate" not in out
    assert "1 point refused" in out or "2 points refused" in out


def test_a_count_of_one_round_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shuffledp.accounting.cli_common import cli_message, plural

    assert main(["account", "compare", "--eps0", "1", "--n", "10000", "--delta", "1e-6", "--bound", "clones"]) == 0
    out = capsys.readouterr().out
    assert "after 1 round of n=10000" in out and "round(s)" not in out
    assert main(["account", "compare", "--eps0", "1", "--n", "10000", "--delta", "1e-6", "--rounds", "2",
                 "--bound", "clones"]) == 0
    assert "after 2 rounds of n=10000" in capsys.readouterr().out
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.append(round=1, n_reports=100, eps0=1.0, mechanism="binary-rr", delta=1e-6,
                      epsilons={"clones": 0.5}, kinds={"clones": "upper"})
    assert main(["ledger", "export", str(path), "--format", "csv", "--out", str(tmp_path / "l.csv")]) == 0
    assert capsys.readouterr().out == f"wrote 1 round to {tmp_path / 'l.csv'} (csv)\n"
    assert cli_message("fmt over 1 rounds needs each round valid") == "fmt over 1 round needs each round valid"
    assert cli_message("fmt over 11 rounds") == "fmt over 11 rounds"
    assert (plural(0, "round"), plural(1, "round"), plural(2, "round")) == ("0 rounds", "1 round", "2 rounds")


def test_ledger_show_leaves_the_run_folder_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ledger.sqlite"
    _ledger(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]
    before = path.read_bytes()
    proc = run("ledger", "show", str(path))
    assert proc.returncode == 0, proc.stderr
    assert main(["ledger", "show", str(path), "--json"]) == 0
    assert main(["ledger", "export", str(path), "--format", "json", "--out", str(tmp_path / "out" / "x.json")]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]
    assert path.read_bytes() == before


def test_a_missing_ledger_is_an_error_and_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["show"], ["export", "--format", "json", "--out", str(tmp_path / "x.json")]):
        assert main(["ledger", command[0], str(tmp_path / "ledger.sqlite"), *command[1:]]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "does not exist" in captured.err
        assert list(tmp_path.iterdir()) == []


def test_ledger_show_prints_the_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shuffledp.accounting.versions import library_versions

    path = tmp_path / "ledger.sqlite"
    _ledger(path)
    versions = library_versions()
    obj = ok_json_in_process(capsys, "ledger", "show", str(path))
    assert obj["versions"] == versions and set(obj) == {"path", "rows", "versions"}
    assert main(["ledger", "show", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())


def test_ledger_show_of_a_ledger_without_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sqlite3

    path = tmp_path / "ledger.sqlite"
    _ledger(path)
    conn = sqlite3.connect(path)  # as an older shuffledp created it: no versions key
    conn.execute("DROP TRIGGER meta_no_delete")
    conn.execute("DELETE FROM meta WHERE key = 'versions'")
    conn.commit()
    conn.close()
    obj = ok_json_in_process(capsys, "ledger", "show", str(path))
    assert obj["versions"] is None and [r["round"] for r in obj["rows"]] == [1, 2]
    assert main(["ledger", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("versions: not recorded") and "binary-rr" in out
