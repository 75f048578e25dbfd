"""Tests of shuffledp.accounting.literature and shuffledp.accounting.mechanisms: published tables, reference values, and
independent recomputations (direct sums, enumerations, numerical integration)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, special, stats

from shuffledp.accounting import RefusedError, literature_rr
from shuffledp.accounting import literature as lit
from shuffledp.accounting.mechanisms import (
    BinaryRandomizedResponse,
    KaryRandomizedResponse,
    LaplaceRandomizer,
    LocalRandomizer,
)

#: Relative agreement required between two exact computations of the same quantity by different routes.
EXACT_RTOL = 1e-9
#: Relative agreement required against the reference values of the project (issue 2: 1e-6).
REFERENCE_RTOL = 1e-6

# Seed 002 (Shvets 2026), Table 1, delta = 1e-6: n, eps0, mu, eps_GDP, eps_FMT (as printed).
SHVETS_TABLE_1 = [
    (10_000, 1, "0.0104", "0.0352", "0.2150"),
    (10_000, 2, "0.0235", "0.0844", "0.5018"),
    (100_000, 1, "0.0033", "0.0101", "0.0727"),
    (100_000, 2, "0.00743", "0.0244", "0.1863"),
    (100_000, 4, "0.0229", "0.0822", "0.5347"),
    (1_000_000, 1, "0.00104", "0.0028", "0.0235"),
    (1_000_000, 2, "0.00235", "0.0070", "0.0626"),
    (1_000_000, 4, "0.00725", "0.0238", "0.2010"),
]


def _rounds_to(value: float, printed: str) -> bool:
    """True if ``value`` rounds to the printed decimal string (same number of decimals)."""
    decimals = len(printed.split(".")[1])
    return abs(value - float(printed)) <= 0.5 * 10.0 ** (-decimals) + 1e-12


@pytest.mark.parametrize("n, eps0, mu_s, gdp_s, fmt_s", SHVETS_TABLE_1)
def test_shvets_table_1_reproduced_to_printed_digits(n: int, eps0: float, mu_s: str, gdp_s: str, fmt_s: str) -> None:
    chi2 = BinaryRandomizedResponse(eps0).chi2
    mu = lit.canonical_mu(chi2, n)
    assert _rounds_to(mu, mu_s), (mu, mu_s)
    assert _rounds_to(lit.gdp_epsilon(mu, 1e-6), gdp_s)
    assert _rounds_to(lit.fmt_epsilon_eq33_as_printed(eps0, n, 1e-6), fmt_s)


def test_fmt_paper_bracketing_differs_from_printed_eq33() -> None:
    # The FMT paper keeps 8e^eps0/n inside the tanh factor: smaller, and it does NOT reproduce Table 1's 0.2150.
    paper = lit.fmt_epsilon(1.0, 10_000, 1e-6)
    printed = lit.fmt_epsilon_eq33_as_printed(1.0, 10_000, 1e-6)
    assert paper < printed
    assert not _rounds_to(paper, "0.2150")
    expected = math.log(1 + math.tanh(0.5) * (8 * math.sqrt(math.e * math.log(4e6)) / 100 + 8 * math.e / 1e4))
    assert paper == pytest.approx(expected, rel=EXACT_RTOL)


def test_fmt_refuses_outside_validity_region() -> None:
    # the pessimistic reading of the region: 16 log(4/delta), the authors' code's, not the 2/delta the paper prints
    limit = lit.fmt_validity_limit(10_000, 1e-6)
    assert limit == pytest.approx(math.log(10_000 / (16 * math.log(4e6))), rel=EXACT_RTOL)
    assert limit < math.log(10_000 / (16 * math.log(2e6)))
    lit.fmt_epsilon(limit * 0.999, 10_000, 1e-6)
    with pytest.raises(RefusedError, match="log\\(n / \\(16 log\\(4/delta\\)\\)\\)"):
        lit.fmt_epsilon(limit * 1.001, 10_000, 1e-6)
    with pytest.raises(RefusedError):
        lit.fmt_epsilon_eq33_as_printed(limit * 1.001, 10_000, 1e-6)


# ----------------------------------------------------------------------------------------------- GDP


@pytest.mark.parametrize("mu, eps", [(0.05, 0.0), (0.05, 0.1), (0.5, 1.0), (1.0, 0.3), (2.0, 4.0)])
def test_gdp_delta_matches_integrated_gaussian_hockey_stick(mu: float, eps: float) -> None:
    # delta = int (phi(x - mu) - e^eps phi(x))_+ dx: the pair N(mu,1) vs N(0,1), integrated numerically.
    threshold = eps / mu + mu / 2.0  # where phi(x - mu) = e^eps phi(x)

    def integrand(x: float) -> float:
        return stats.norm.pdf(x - mu) - math.exp(eps) * stats.norm.pdf(x)

    direct, _ = integrate.quad(integrand, threshold, np.inf, epsabs=1e-15, epsrel=1e-12)
    assert lit.gdp_delta(mu, eps) == pytest.approx(direct, rel=1e-8)


@pytest.mark.parametrize("mu", [1e-3, 0.02, 0.3, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-4, 1e-8, 1e-12])
def test_gdp_epsilon_inverts_gdp_delta(mu: float, delta: float) -> None:
    eps = lit.gdp_epsilon(mu, delta)
    assert eps > 0
    assert lit.gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-9)


def test_gdp_delta_far_tail_matches_high_precision() -> None:
    # Phi(a) - e^eps Phi(b) deep in the tail: the log-space form keeps its relative accuracy.
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    for mu, eps in [(0.01, 0.1), (0.02, 0.3), (0.5, 12.0)]:
        a, b = -eps / mu + mu / 2, -eps / mu - mu / 2
        exact = mpmath.ncdf(a) - mpmath.e**eps * mpmath.ncdf(b)
        d = lit.gdp_delta(mu, eps)
        assert d > 0.0
        assert d == pytest.approx(float(exact), rel=1e-9)


def test_ccg_formulas() -> None:
    mu = lit.ccg_gdp_mu(2.0, 10_001)
    assert mu == pytest.approx(2 * math.e / 100, rel=EXACT_RTOL)
    # Cor. 2 is Thm 2 through mu-GDP => (lambda, mu^2 lambda / 2)-RDP.
    for order in (2.0, 5.0, 64.0):
        assert lit.ccg_rdp(2.0, 10_001, order) == pytest.approx(mu * mu * order / 2, rel=EXACT_RTOL)
    with pytest.raises(RefusedError):
        lit.ccg_gdp_mu(1.0, 1)


def test_clt_rule() -> None:
    # n/(e^eps0+1) >= 2 ln(1/delta): 1e4/(e^8+1) = 3.35 < 27.6 at eps0=8 (the seeds README's unsafe example).
    assert not lit.clt_expected_clones_ok(8.0, 10_000, 1e-6)
    assert lit.clt_expected_clones_ok(1.0, 10_000, 1e-6)
    with pytest.raises(RefusedError, match="allow_approximate"):
        lit.require_clt_regime("ccg-gdp", 8.0, 10_000, 1e-6, allow_approximate=False)
    lit.require_clt_regime("ccg-gdp", 8.0, 10_000, 1e-6, allow_approximate=True)


# ------------------------------------------------------------------------------------------- Girgis


def test_girgis_formulas_by_hand() -> None:
    eps0, n, lam = 1.0, 10_000, 3
    nbar = math.floor((n - 1) / (2 * math.e)) + 1
    upper = math.log(math.exp(lam**2 * (math.e - 1) ** 2 / nbar) + math.exp(eps0 * lam - (n - 1) / (8 * math.e)))
    assert lit.girgis_rdp_upper(eps0, n, lam) == pytest.approx(upper / (lam - 1), rel=EXACT_RTOL)
    lower = math.log(1 + lam * (lam - 1) / 2 * (math.e - 1) ** 2 / (n * math.e)) / (lam - 1)
    assert lit.girgis_rdp_lower(eps0, n, lam) == pytest.approx(lower, rel=EXACT_RTOL)
    with pytest.raises(RefusedError, match="integer"):
        lit.girgis_rdp_upper(eps0, n, 2.5)


@pytest.mark.parametrize("eps0, n", [(0.5, 1_000), (1.0, 10_000), (2.0, 10_000), (4.0, 100_000)])
def test_girgis_brackets_exact_rr_renyi(eps0: float, n: int) -> None:
    # The Girgis upper bound holds for every eps0-LDP randomizer, so it is >= the exact value for binary RR;
    # the Girgis lower bound is the second-order term of that same binary-RR divergence, so it is <= it.
    for lam in (2, 4, 16, 64):
        exact = lit.rr_lower_renyi(eps0, n, lam)
        assert lit.girgis_rdp_upper(eps0, n, lam) >= exact
        assert lit.girgis_rdp_lower(eps0, n, lam) <= exact * (1 + EXACT_RTOL)


# ------------------------------------------------------------------------------------------ rr-lower


def test_rr_lower_reference_value() -> None:
    assert lit.rr_lower_epsilon(1.0, 10_000, 1e-6) == pytest.approx(0.03565881530, rel=REFERENCE_RTOL)


def _rr_direct(eps0: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """P0 = Bin(n-1,q) * Bern(q), P1 = Bin(n-1,q) * Bern(1-q) by explicit convolution (independent route)."""
    q = 1.0 / (math.exp(eps0) + 1.0)
    base = stats.binom.pmf(np.arange(n), n - 1, q)
    p0 = np.convolve(base, [1 - q, q])
    p1 = np.convolve(base, [q, 1 - q])
    return p0, p1


@pytest.mark.parametrize("eps0, n", [(0.5, 20), (1.0, 200), (3.0, 50), (6.0, 400)])
def test_rr_lower_delta_and_renyi_match_direct_convolution(eps0: float, n: int) -> None:
    p0, p1 = _rr_direct(eps0, n)
    for eps in (0.0, 0.01, 0.1, 0.5 * eps0):
        direct = max(np.maximum(p1 - math.exp(eps) * p0, 0).sum(), np.maximum(p0 - math.exp(eps) * p1, 0).sum())
        assert lit.rr_lower_delta(eps0, n, eps) == pytest.approx(direct, rel=1e-9, abs=1e-300)
    pos = (p0 > 0) & (p1 > 0)  # both vanish together (only underflow can zero one of them)
    l0, l1 = np.log(p0[pos]), np.log(p1[pos])
    for lam in (1.5, 2.0, 8.0):
        fwd = special.logsumexp(lam * l1 + (1 - lam) * l0) / (lam - 1)
        bwd = special.logsumexp(lam * l0 + (1 - lam) * l1) / (lam - 1)
        assert lit.rr_lower_renyi(eps0, n, lam) == pytest.approx(max(fwd, bwd), rel=1e-7)


def test_rr_lower_epsilon_inverts_delta_and_is_at_most_eps0() -> None:
    for eps0, n, delta in [(1.0, 10_000, 1e-6), (4.0, 1_000, 1e-8), (0.1, 10, 1e-4)]:
        eps = lit.rr_lower_epsilon(eps0, n, delta)
        assert 0 < eps <= eps0
        assert lit.rr_lower_delta(eps0, n, eps) == pytest.approx(delta, rel=1e-7)


def test_rr_lower_renyi_approaches_shvets_leading_term() -> None:
    # seed 002, Theorem 9: D_a = a chi^2 / (2n) + O(n^-2).
    eps0, n, a = 1.0, 1_000_000, 4.0
    chi2 = BinaryRandomizedResponse(eps0).chi2
    assert lit.rr_lower_renyi(eps0, n, a) == pytest.approx(a * chi2 / (2 * n), rel=1e-4)


def test_rr_lower_stable_at_one_million() -> None:
    rr = lit.rr_shuffle_loss(2.0, 1_000_000)
    total = special.logsumexp(rr.log_p0)
    assert abs(total) < 1e-12  # normalised
    assert np.all(np.isfinite(rr.loss))
    d = lit.rr_lower_delta(2.0, 1_000_000, 0.001)
    assert 0.0 <= d <= 1.0 and math.isfinite(d)


# --------------------------------------------------------------------------------------- canonical


def test_canonical_jsd_expansion_matches_exact_jsd() -> None:
    # Exact JSD of the canonical pair for binary RR, summed over the count of ones (seed 002, Theorem 7).
    eps0, n = 1.0, 2_000
    rr = BinaryRandomizedResponse(eps0)
    q = rr.flip_probability
    k = np.arange(n + 1)
    t0 = stats.binom.pmf(k, n, q)  # all users hold 0: count of ones ~ Bin(n, q)
    t1 = t0 * ((n - k) * math.exp(-eps0) + k * math.exp(eps0)) / n  # seed 002 Lemma 3
    m = 0.5 * (t0 + t1)
    mask = t0 > 0
    exact = 0.5 * np.sum(t0[mask] * np.log(t0[mask] / m[mask])) + 0.5 * np.sum(t1[mask] * np.log(t1[mask] / m[mask]))
    approx = lit.canonical_jsd_expansion(rr.chi2, rr.mu3, n)
    first_order = rr.chi2 / (8 * n)
    # the O(n^-2) terms make the expansion closer than the first-order term alone; remainder is O(n^-3)
    assert abs(exact - approx) < abs(exact - first_order)
    assert abs(exact - approx) < 50 * rr.chi2**3 / n**3


# --------------------------------------------------------------------------------------- no-shuffle


def _no_shuffle_enumerated(eps0: float, rounds: int, eps: float) -> float:
    """delta of T-fold binary RR by enumerating all 2^T output sequences (independent route)."""
    p = math.exp(eps0) / (1 + math.exp(eps0))
    total = 0.0
    for outs in itertools.product((0, 1), repeat=rounds):
        ones = sum(outs)
        pp = p**ones * (1 - p) ** (rounds - ones)
        qq = (1 - p) ** ones * p ** (rounds - ones)
        total += max(pp - math.exp(eps) * qq, 0.0)
    return total


@pytest.mark.parametrize("eps0, rounds", [(0.3, 6), (1.0, 5), (2.0, 3)])
def test_no_shuffle_delta_matches_enumeration(eps0: float, rounds: int) -> None:
    for eps in (0.0, 0.2, 1.0, 0.9 * rounds * eps0):
        assert lit.no_shuffle_delta(eps0, rounds, eps) == pytest.approx(
            _no_shuffle_enumerated(eps0, rounds, eps), rel=1e-10, abs=1e-15
        )


def test_no_shuffle_single_round_closed_form() -> None:
    eps0, eps = 1.5, 0.4
    expected = (math.exp(eps0) - math.exp(eps)) / (1 + math.exp(eps0))
    assert lit.no_shuffle_delta(eps0, 1, eps) == pytest.approx(expected, rel=EXACT_RTOL)
    e = lit.no_shuffle_epsilon(eps0, 1, 1e-6)
    assert e == pytest.approx(math.log(math.exp(eps0) - 1e-6 * (1 + math.exp(eps0))), rel=1e-10)


# --------------------------------------------------------------------------------------- mechanisms


def test_laplace_eps0_is_derived_from_clip_and_scale() -> None:
    m = LaplaceRandomizer(clip_l1=0.5, noise_scale=0.25, dimension=100)
    assert m.eps0 == pytest.approx(4.0, rel=EXACT_RTOL)  # 2C/b: the L1 diameter of the clip ball
    assert LaplaceRandomizer.for_eps0(2.0, 1.0, 3).noise_scale == pytest.approx(1.0, rel=EXACT_RTOL)
    with pytest.raises(AttributeError):
        m.eps0 = 1.0
    with pytest.raises(TypeError):
        LaplaceRandomizer(clip_l1=1.0, noise_scale=1.0, eps0=2.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_l1": 0.0, "noise_scale": 1.0}, "clip_l1"),
        ({"clip_l1": 1.0, "noise_scale": -1.0}, "noise_scale"),
        ({"clip_l1": float("inf"), "noise_scale": 1.0}, "clip_l1"),
        ({"clip_l1": 1.0, "noise_scale": 1.0, "dimension": 0}, "dimension"),
    ],
)
def test_laplace_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LaplaceRandomizer(**kwargs)


def test_randomized_response_descriptions() -> None:
    for eps0 in (0.1, 1.0, 5.0):
        for k in (2, 3, 10):
            rr = KaryRandomizedResponse(eps0, k)
            w0, w1 = np.array(rr.output_distribution(0)), np.array(rr.output_distribution(1))
            assert w0.sum() == pytest.approx(1.0, rel=EXACT_RTOL)
            assert np.max(w0 / w1) == pytest.approx(math.exp(eps0), rel=EXACT_RTOL)  # exactly eps0-LDP
            assert rr.chi2 == pytest.approx(np.sum((w1 - w0) ** 2 / w0), rel=1e-9)
            assert rr.mu3 == pytest.approx(np.sum(w0 * (w1 / w0 - 1) ** 3), rel=1e-9)
        b = BinaryRandomizedResponse(eps0)
        assert b.chi2 == pytest.approx(math.expm1(eps0) ** 2 / math.exp(eps0), rel=1e-12)
        assert b.chi2 == pytest.approx(b.as_kary().chi2, rel=1e-12)
        assert b.mu3 == pytest.approx(b.as_kary().mu3, rel=1e-9)
    with pytest.raises(ValueError, match="k"):
        KaryRandomizedResponse(1.0, 1)
    with pytest.raises(ValueError, match="eps0"):
        LocalRandomizer(0.0)
    with pytest.raises(TypeError, match="eps0"):
        BinaryRandomizedResponse(True)
    assert LocalRandomizer(2).eps0 == 2.0


# ------------------------------------------------------------------------------------------------ rdp


def test_rdp_conversion_matches_dp_accounting() -> None:
    from dp_accounting.rdp import rdp_privacy_accountant as ref

    from shuffledp.accounting import rdp

    orders = rdp.DEFAULT_ORDERS
    for scale in (1e-6, 1e-3, 0.1, 2.0):
        curve = scale * orders  # a Gaussian-like linear curve
        for d in (1e-4, 1e-8):
            ours, a_ours = rdp.epsilon_from_rdp(orders, curve, d)
            theirs, _ = ref.compute_epsilon(orders, curve, d)
            assert ours == pytest.approx(theirs, rel=1e-12)
            back, _ = rdp.delta_from_rdp(orders, curve, ours)
            their_back, _ = ref.compute_delta(orders, curve, ours)
            assert back == pytest.approx(min(their_back, 1.0), rel=1e-9)
            assert back <= d * (1 + 1e-9)


def test_rdp_conversion_is_sound_for_the_gaussian_mechanism() -> None:
    # Gaussian mechanism with sensitivity 1 and noise sigma: RDP alpha / (2 sigma^2) (Mironov 2017, Prop. 7),
    # exact (eps, delta) curve = mu-GDP with mu = 1/sigma. The conversion must not go below the exact curve.
    from shuffledp.accounting import rdp

    for sigma in (0.5, 1.0, 5.0, 50.0):
        curve = rdp.DEFAULT_ORDERS / (2 * sigma**2)
        for d in (1e-5, 1e-10):
            converted, _ = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, curve, d)
            exact = lit.gdp_epsilon(1.0 / sigma, d)
            assert exact <= converted <= exact * 1.5


def test_rdp_validation_and_composition() -> None:
    from shuffledp.accounting import rdp

    a = np.array([2.0, 4.0])
    assert np.allclose(rdp.compose_rdp([(np.array([1.0, 2.0]), 3), (np.array([0.5, 0.5]), 2)]), [4.0, 7.0])
    with pytest.raises(ValueError, match="> 1"):
        rdp.epsilon_from_rdp(np.array([1.0, 2.0]), np.array([0.1, 0.1]), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        rdp.epsilon_from_rdp(a, np.array([0.1, 0.1]), 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        rdp.epsilon_from_rdp(a, np.array([-0.1, 0.1]), 1e-6)
    with pytest.raises(ValueError, match="share"):
        rdp.compose_rdp([(np.ones(2), 1), (np.ones(3), 1)])
    assert rdp.epsilon_from_rdp(a, np.array([np.inf, 0.01]), 1e-6)[1] == 4.0


def test_canonical_gdp_for_kary_randomizers() -> None:
    from shuffledp.accounting import bounds

    # binary RR through the mechanism equals the canonical-gdp family
    family = bounds.epsilon("canonical-gdp", 2.0, 100_000, 1e-6, rounds=4).value
    assert lit.canonical_gdp_epsilon(BinaryRandomizedResponse(2.0), 100_000, 1e-6, rounds=4) == pytest.approx(
        family, rel=EXACT_RTOL
    )
    # a larger alphabet spreads the same eps0 over more symbols: smaller chi^2, smaller epsilon
    e2 = lit.canonical_gdp_epsilon(KaryRandomizedResponse(2.0, 2), 100_000, 1e-6)
    e10 = lit.canonical_gdp_epsilon(KaryRandomizedResponse(2.0, 10), 100_000, 1e-6)
    assert e10 < e2
    with pytest.raises(TypeError, match="chi2"):
        lit.canonical_gdp_epsilon(LaplaceRandomizer(1.0, 1.0), 100_000, 1e-6)


@pytest.mark.parametrize("eps0, n, order", [(4.0, 10, 256.0), (6.0, 10_000, 256.0), (3.0, 50, 1000.0)])
def test_rr_lower_renyi_high_order_is_finite_and_below_clones(eps0: float, n: int, order: float) -> None:
    # order * eps0 > 709: expm1(order * loss) overflowed and p0 underflow must not give 0 * inf = NaN.
    assert order * eps0 > 709
    import warnings

    from shuffledp.accounting import bounds

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lower = bounds.renyi("rr-lower", eps0, n, order).value
    upper = bounds.renyi("clones", eps0, n, order).value
    assert math.isfinite(lower) and 0.0 < lower <= eps0 * order / (order - 1.0)
    assert lower <= upper * (1.0 + 1e-12)  # equal up to rounding where both reach the largest loss


def test_rr_lower_renyi_high_order_matches_direct_convolution_in_log_space() -> None:
    eps0, n = 4.0, 60
    p0, p1 = _rr_direct(eps0, n)
    pos = (p0 > 0) & (p1 > 0)
    l0, l1 = np.log(p0[pos]), np.log(p1[pos])
    for lam in (200.0, 256.0, 2000.0):
        fwd = special.logsumexp(lam * l1 + (1 - lam) * l0) / (lam - 1)
        bwd = special.logsumexp(lam * l0 + (1 - lam) * l1) / (lam - 1)
        assert lit.rr_lower_renyi(eps0, n, lam) == pytest.approx(max(fwd, bwd), rel=1e-9)


def test_rr_lower_renyi_small_divergence_keeps_relative_accuracy() -> None:
    # Tiny divergence: the log1p(sum expm1) path; compare with 50-digit arithmetic.
    import mpmath

    eps0, n, lam = 0.1, 2_000, 1.5
    with mpmath.workdps(50):
        q = mpmath.mpf(1) / (mpmath.e ** mpmath.mpf(eps0) + 1)
        fwd = mpmath.mpf(0)
        bwd = mpmath.mpf(0)
        for k in range(n + 1):
            # P0: Bin(n-1, q) + Bern(q); P1: Bin(n-1, q) + Bern(1-q)
            def b(j: int, n: int = n, q: object = q) -> object:
                return mpmath.binomial(n - 1, j) * q**j * (1 - q) ** (n - 1 - j) if 0 <= j <= n - 1 else 0

            a0 = b(k) * (1 - q) + b(k - 1) * q
            a1 = b(k) * q + b(k - 1) * (1 - q)
            fwd += a1**lam * a0 ** (1 - lam)
            bwd += a0**lam * a1 ** (1 - lam)
        exact = float(max(mpmath.log(fwd), mpmath.log(bwd)) / (lam - 1))
    assert lit.rr_lower_renyi(eps0, n, lam) == pytest.approx(exact, rel=1e-8)


def test_root_found_epsilons_are_on_the_certified_side() -> None:
    """brentq lands within its tolerance on either side of the root; the reported epsilon must meet delta:
    delta(eps) <= delta for the no-shuffle upper bound, >= delta for the rr lower bound (brentq's own answer is on
    the wrong side for about half of these settings, by up to 1.7e-5 relative in delta)."""
    import itertools

    from shuffledp.accounting import literature as lit

    for eps0, rounds, delta in itertools.product([0.5, 2.0, 8.0], [1, 5, 50], [1e-3, 1e-9]):
        eps = lit.no_shuffle_epsilon(eps0, rounds, delta)
        assert lit.no_shuffle_delta(eps0, rounds, eps) <= delta, (eps0, rounds, delta)
    for eps0, n, delta in itertools.product([0.5, 2.0, 8.0], [10, 1000, 100000], [1e-3, 1e-9]):
        eps = lit.rr_lower_epsilon(eps0, n, delta)
        if eps > 0:
            assert literature_rr._rr_delta_from(lit.rr_shuffle_loss(eps0, n), eps) >= delta, (eps0, n, delta)


def test_randomizer_descriptions_refuse_eps0_beyond_the_accepted_range() -> None:
    """Beyond EPS0_MAX the chi^2 / mu_3 formulas overflowed (OverflowError at eps0 ~ 360) and a Laplace scale
    could describe eps0 = 2e5 without complaint; now each refuses at construction and says the range."""
    from shuffledp.accounting import EPS0_MAX
    from shuffledp.accounting.mechanisms import BinaryRandomizedResponse, KaryRandomizedResponse, LaplaceRandomizer

    assert math.isfinite(KaryRandomizedResponse(EPS0_MAX, 3).chi2)
    assert math.isfinite(BinaryRandomizedResponse(EPS0_MAX).mu3)
    for make in (lambda: KaryRandomizedResponse(360.0, 3), lambda: BinaryRandomizedResponse(720.0),
                 lambda: LaplaceRandomizer(clip_l1=1.0, noise_scale=1e-5),
                 lambda: LaplaceRandomizer.for_eps0(101.0, 1.0)):
        with pytest.raises(ValueError, match="100"):
            make()
