"""``shuffledp audit privacy``: the empirical lower bound is valid (never above the accountant's upper bound for
the real randomizer), has teeth (exceeds the claimed epsilon of deliberately broken randomizers), its statistics
are the textbook ones, and the in-process path is the path through the real shuffler."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from shuffledp.deploy.audit_cli import main as audit_main
from shuffledp.deploy.audit_privacy import (
    choose_threshold,
    clopper_pearson_lower,
    clopper_pearson_upper,
    epsilon_lower_bound,
    gaussian_audit_expectation,
    gaussian_fit_epsilon,
    gdp_mu,
    reference_bounds,
    run_audit,
)
from shuffledp.deploy.audit_privacy_cli import main as privacy_main
from shuffledp.deploy.audit_privacy_pipelines import (
    AuditInstance,
    BrokenNumpyFloatPipeline,
    BrokenPerRecordPipeline,
    LaplacePipeline,
    float_laplace_member,
    make_pipeline,
)

DELTA = 1e-6

# -- statistics -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "n", "alpha"), [(0, 10, 0.05), (3, 10, 0.025), (50, 1000, 0.025), (999, 1000, 0.05),
                                               (1000, 1000, 0.05), (7, 20000, 0.001)])
def test_clopper_pearson_matches_scipy_beta_and_exact_binomial(k: int, n: int, alpha: float) -> None:
    hi = float(clopper_pearson_upper(k, n, alpha))
    lo = float(clopper_pearson_lower(k, n, alpha))
    assert hi == pytest.approx(1.0 if k == n else stats.beta.ppf(1 - alpha, k + 1, n - k), rel=1e-12)
    assert lo == pytest.approx(0.0 if k == 0 else stats.beta.ppf(alpha, k, n - k + 1), rel=1e-12)
    # the defining property: at the bound, the chance of seeing at most (at least) k is exactly alpha
    if k < n:
        assert stats.binom.cdf(k, n, hi) == pytest.approx(alpha, rel=1e-6)
    if k > 0:
        assert stats.binom.sf(k - 1, n, lo) == pytest.approx(alpha, rel=1e-6)
    assert lo <= k / n <= hi


def test_clopper_pearson_known_values() -> None:
    # zero events in n trials: the upper bound is 1 - alpha^(1/n) (the "rule of three" for alpha = 0.05)
    assert float(clopper_pearson_upper(0, 100, 0.05)) == pytest.approx(1 - 0.05 ** (1 / 100), rel=1e-12)
    assert float(clopper_pearson_upper(0, 1000, 0.05)) * 1000 == pytest.approx(2.99125, abs=1e-5)
    # all events: the lower bound is alpha^(1/n)
    assert float(clopper_pearson_lower(50, 50, 0.025)) == pytest.approx(0.025 ** (1 / 50), rel=1e-12)


def test_epsilon_lower_bound_formula_and_bonferroni_split() -> None:
    fpr = 1 - 0.025 ** (1 / 1000)  # 0 false positives of 1000 at alpha/2 = 0.025
    fnr = float(stats.beta.ppf(0.975, 101, 900))  # 100 false negatives of 1000
    want = math.log((1 - DELTA - fnr) / fpr)
    assert float(epsilon_lower_bound(0, 1000, 100, 1000, DELTA, 0.05)) == pytest.approx(want, rel=1e-10)
    # a useless test gives 0, never a negative number
    assert float(epsilon_lower_bound(500, 1000, 500, 1000, DELTA, 0.05)) == 0.0


def test_threshold_choice_finds_the_separating_threshold() -> None:
    a = np.arange(100, 200, dtype=float)
    b = np.arange(0, 100, dtype=float)
    direction, sign, t, eps = choose_threshold(a, b, DELTA, 0.05)
    assert (direction, sign) == ("a", 1) and 99 <= t < 100
    assert eps == pytest.approx(float(epsilon_lower_bound(0, 100, 0, 100, DELTA, 0.05)))
    direction, sign, t, _ = choose_threshold(b, a, DELTA, 0.05)  # reversed: a high score points to b
    assert sign == -1 and -100 <= t < -99
    # overlapping scores: the best rule on the held-apart trials is no better than perfect separation
    _, _, _, eps_overlap = choose_threshold(a, a - 50, DELTA, 0.05)
    assert 0 < eps_overlap < eps


def test_gaussian_fit_recovers_gdp() -> None:
    rng = np.random.default_rng(1)  # test data only
    mu = 0.5
    la = rng.normal(mu**2 / 2, mu, 200_000)
    lb = rng.normal(-(mu**2) / 2, mu, 200_000)
    eps = gaussian_fit_epsilon(la, lb, 1e-5)
    delta_at = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
    assert delta_at == pytest.approx(1e-5, rel=0.2)


def test_gaussian_expectation_grows_with_trials_and_stays_below_the_gdp_epsilon() -> None:
    mu = gdp_mu(0.5, 1e-6)
    got = [gaussian_audit_expectation(mu, m, 1e-6, 0.95) for m in (1e3, 1e5, 1e7)]
    assert got[0] < got[1] < got[2] < 0.5
    # the mu-GDP curve through (0.5, 1e-6) (Dong, Roth, Su, Cor. 2.13)
    assert stats.norm.cdf(-0.5 / mu + mu / 2) - math.exp(0.5) * stats.norm.cdf(-0.5 / mu - mu / 2) == \
        pytest.approx(1e-6, rel=1e-6)


# -- the bulk in-process path is the randomizer -----------------------------------------------------------------


def test_bulk_path_equals_the_client_randomize_and_decode_for_fixed_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = AuditInstance(2.0, 6)
    pipe = LaplacePipeline(inst)
    noise = np.arange(-30, 30, dtype=np.int64) * 12345  # 5 trials x 6 reports x 2 coordinates

    def fixed(m: int, rng: object = None) -> np.ndarray:
        return noise[:m].copy()

    monkeypatch.setattr(pipe.sampler, "sample", fixed)
    bulk = pipe.noisy("a", 5)
    # the same noise through the mechanism's own randomize (clip, grid, projection, encode) and the decoder
    flat = iter(noise.reshape(-1, 2))
    monkeypatch.setattr(pipe.randomizer.sampler, "sample", lambda m, rng=None: next(flat).copy())
    per = np.stack([pipe.per_report("a") for _ in range(5)])
    assert np.array_equal(bulk, per)
    assert np.array_equal(bulk[:, 0, :], np.broadcast_to(pipe.q["a"] + noise.reshape(5, 6, 2)[:, 0], (5, 2)))


def test_bulk_and_per_report_scores_have_the_same_distribution() -> None:
    # two-sample Kolmogorov-Smirnov test at level 1e-3 (a false alarm once in a thousand runs)
    inst = AuditInstance(4.0, 4)
    pipe = LaplacePipeline(inst)
    bulk = pipe.round_scores("a", 3000)
    per = np.array([pipe.score(pipe.per_report("a")) for _ in range(600)])
    assert stats.ks_2samp(bulk, per).pvalue > 1e-3
    # and the test would see a different mechanism: the same scores at another eps0 are rejected
    other = LaplacePipeline(AuditInstance(3.0, 4))
    other.q, other.noise_num = pipe.q, pipe.noise_num  # score as eps0 = 4, sample as eps0 = 3
    assert stats.ks_2samp(bulk, other.score(other.noisy("a", 3000))).pvalue < 1e-3


def test_score_is_the_exact_log_likelihood_ratio_of_the_multiset() -> None:
    inst = AuditInstance(1.5, 3)
    pipe = LaplacePipeline(inst)
    y = pipe.noisy("b", 1)[0]
    s = pipe.s

    def log_p(row: np.ndarray, x: np.ndarray) -> float:
        return -s * float(np.abs(row - x).sum())

    def log_p_multiset(canary: np.ndarray) -> float:  # sum over which report is the canary's (others identical)
        terms = [log_p(y[j], canary) + sum(log_p(y[i], pipe.q["o"]) for i in range(3) if i != j) for j in range(3)]
        return float(np.logaddexp.reduce(terms))

    assert float(pipe.score(y)) == pytest.approx(log_p_multiset(pipe.q["a"]) - log_p_multiset(pipe.q["b"]), abs=1e-9)
    assert float(pipe.score(y[::-1])) == pytest.approx(float(pipe.score(y)), abs=1e-12)  # symmetric in the order


# -- validity: the real randomizer never beats the accountant ----------------------------------------------------


@pytest.mark.parametrize(("eps0", "n", "rounds"), [(4.0, 4, 1), (4.0, 4, 3), (2.0, 4, 3), (1.0, 20, 1),
                                                   (4.0, 30, 1), (2.0, 100, 2)])
def test_real_laplace_lower_bound_never_exceeds_the_upper_bound(eps0: float, n: int, rounds: int) -> None:
    res = run_audit(make_pipeline("laplace", AuditInstance(eps0, n)), rounds=rounds, trials=3000, delta=DELTA)
    upper = res.references["clones"]["value"]
    assert res.references["clones"]["kind"] == "upper" and res.references["rr-lower"]["kind"] == "lower"
    assert 0.0 <= res.epsilon_lower <= upper, res.as_dict()
    # and below every other upper bound the accountant has for it (a mechanism-aware family when present)
    for fam, ref in res.references.items():
        if ref.get("kind") == "upper":
            assert res.epsilon_lower <= ref["value"], (fam, res.as_dict())


def test_real_laplace_audit_has_power_where_privacy_is_weak() -> None:
    # n = 4 reports at eps0 = 4 over 3 rounds: little amplification, the audit must certify a large part of it
    res = run_audit(make_pipeline("laplace", AuditInstance(4.0, 4)), rounds=3, trials=3000, delta=DELTA)
    assert res.epsilon_lower > 2.0, res.as_dict()


# -- teeth: the broken randomizers ------------------------------------------------------------------------------


def test_per_record_calibration_is_caught() -> None:
    # m = 10 records, eps0 = 1: the report is 10-LDP; the pipeline would claim clones(1, 100) = 0.52, and eps0 = 1
    pipe = BrokenPerRecordPipeline(AuditInstance(1.0, 100), records=10)
    res = run_audit(pipe, rounds=1, trials=600, delta=DELTA)
    assert res.broken and res.epsilon_lower > max(res.references["clones"]["value"], 1.0) + 1.0, res.as_dict()


def test_numpy_float_laplace_is_caught() -> None:
    pipe = BrokenNumpyFloatPipeline(AuditInstance(1.0, 20, dim=1, others="same"))
    res = run_audit(pipe, rounds=1, trials=600, delta=DELTA)
    assert res.false_positives == 0  # a report no b-side input can produce never appears under b
    assert res.epsilon_lower > max(res.references["clones"]["value"], 1.0) + 1.0, res.as_dict()


def test_float_laplace_membership_is_exact_on_numpy_outputs() -> None:
    scale = 2.0
    rs = np.random.RandomState(int.from_bytes(os.urandom(4), "little"))
    for x in (1.0, -1.0, 0.0):
        y = rs.laplace(x, scale, 4000)
        assert float_laplace_member(y, x, scale).all()  # every output of x is recognised as x's
    y = rs.laplace(1.0, scale, 4000)
    ruled_out = 1.0 - float_laplace_member(y, -1.0, scale).mean()
    assert 0.6 < ruled_out < 0.95  # most releases of +1 cannot come from -1 (about 80% at eps0 = 1)
    # the ruled-out releases are exactly the ones the other input's sampler cannot reach: perturbing an output by
    # one ulp leaves the set of outputs of its own input for most releases (the output set is porous)
    assert float_laplace_member(np.nextafter(y, np.inf), 1.0, scale).mean() < 0.9


def test_numpy_forward_model_reproduces_numpy_bit_for_bit() -> None:
    from shuffledp.deploy.audit_privacy_pipelines import _forward

    seed = int.from_bytes(os.urandom(4), "little")
    y = np.random.RandomState(seed).laplace(0.75, 1.5, 5000)
    u = np.random.RandomState(seed).random_sample(5000)
    k = np.rint(u * 2.0**53).astype(np.int64)
    up = k >= 2**52
    got = np.where(up, _forward(k, np.full(5000, 0.75), 1.5, True), _forward(k, np.full(5000, 0.75), 1.5, False))
    assert np.array_equal(got, y)


# -- the real shuffler ------------------------------------------------------------------------------------------


def test_end_to_end_multiset_equals_the_in_process_one_for_fixed_noise(tmp_path: object) -> None:
    from shuffledp.deploy.audit_privacy_e2e import in_process_multiset, shuffled_multisets

    inst = AuditInstance(2.0, 6)
    keys = [[os.urandom(32) for _ in range(inst.n)] for _ in range(2)]
    got = shuffled_multisets(inst, ["a", "b"], noise_keys=keys, workdir=tmp_path)
    for hyp, multiset, k in zip("ab", got, keys):
        want = in_process_multiset(inst, hyp, k)
        assert np.array_equal(multiset, want)
        pipe = LaplacePipeline(inst)
        assert float(pipe.score(multiset)) == pytest.approx(float(pipe.score(want)))
    assert not np.array_equal(got[0], in_process_multiset(inst, "a", keys[1]))  # the comparison can fail


# -- accounting references and the CLI --------------------------------------------------------------------------


def test_reference_bounds_have_their_kinds_and_hook() -> None:
    refs = reference_bounds(2.0, 100, DELTA, 1)
    assert refs["clones"]["kind"] == "upper" and refs["rr-lower"]["kind"] == "lower"
    assert refs["rr-lower"]["value"] <= refs["clones"]["value"]
    from shuffledp.accounting import FAMILIES

    for fam in ("blanket-laplace",):
        assert (fam in refs) == (fam in FAMILIES)


def test_cli_prints_the_table_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert audit_main(["audit", "privacy", "--eps0", "4", "--n", "5", "--trials", "400"]) == 0
    out = capsys.readouterr().out
    assert "audit lb" in out and "clones (upper)" in out and "rr-lower (lower)" in out
    assert privacy_main(["--pipeline", "broken-per-record", "--eps0", "1", "--n", "50", "--trials", "300",
                         "--json"]) == 1
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["broken"] and row["epsilon_lower"] > row["references"]["clones"]["value"]


@pytest.mark.parametrize("argv", [["--eps0", "x"], ["--eps0", "0"], ["--n", "1"], ["--trials", "5"],
                                  ["--delta", "1.5"], ["--confidence", "1"], ["--others", "nope"],
                                  ["--others", "orthogonal", "--dim", "1"], ["--pipeline", "gauss"],
                                  ["--records", "1", "--pipeline", "broken-per-record"],
                                  ["--end-to-end", "2", "--pipeline", "broken-numpy-float"], ["--rounds", "0"],
                                  ["--end-to-end", "1", "--log2-grid", "-1"], ["--log2-grid", "60"]])
def test_cli_bad_input_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert privacy_main(argv) == 2
    assert capsys.readouterr().err.strip()


def test_cli_log2_grid_sets_the_audited_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert privacy_main(["--eps0", "4", "--n", "3", "--others", "same", "--log2-grid", "-1", "--trials", "2000",
                         "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["epsilon_lower"] <= row["references"]["blanket-laplace"]["value"]
    assert LaplacePipeline(AuditInstance(4.0, 3, dim=1, others="same", log2_grid=-1)).randomizer.radius == 2


def test_cli_plot_writes_pngs(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    prefix = Path(str(tmp_path)) / "fig"
    assert privacy_main(["--eps0", "2,4", "--n", "5,10", "--trials", "200", "--plot", str(prefix)]) == 0
    for name in ("fig_vs_eps0.png", "fig_vs_n.png"):
        assert (prefix.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
