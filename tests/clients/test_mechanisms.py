"""The L2 mechanisms (duchi, privunit2) and the one interface over all three: any-input privacy ratio (exact for
duchi's one coin, statistical for privunit2), unbiased decoding, fixed-length reports, malformed reports refused."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest

from shuffledp.clients.coins import bernoulli, exp_lower, rr_interval
from shuffledp.clients.duchi import DuchiMechanism, mean_abs_coordinate
from shuffledp.clients.mechanism import MECHANISMS, Mechanism, make_mechanism
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.privunit import PrivUnit2Mechanism, cap_mass, privunit_params
from shuffledp.clients.report import ReportError
from shuffledp.clients.sphere import clip_l2, direction_from_seed, directions

mpmath.mp.dps = 80


def _rng(tag: int) -> ChaCha20Rng:
    return ChaCha20Rng(bytes([tag]) * 32)


def _e(eps: float) -> Fraction:
    """e^eps as a rational, 80 digits (far tighter than the checks below need)."""
    return Fraction(str(mpmath.e ** mpmath.mpf(eps)))


# -- exact coins --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps0", [1e-9, 1e-3, 0.46, 1.0, 2.02, 4.0, 8.0, 30.0, 64.0])
def test_rr_interval_ratios_hold_exactly_for_the_floats(eps0: float) -> None:
    p_lo, p_hi = rr_interval(eps0)
    lo, hi, e = Fraction(p_lo), Fraction(p_hi), _e(eps0)
    assert hi / lo <= e and (1 - lo) / (1 - hi) <= e
    # and tight: within a few ulps of the ideal interval
    assert math.isclose(p_lo, 1 / (math.exp(eps0) + 1), rel_tol=1e-12)
    assert exp_lower(eps0) <= e


def test_rr_interval_refuses_bad_eps0() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan, 64.5):
        with pytest.raises(ValueError, match="eps0"):
            rr_interval(bad)
    with pytest.raises(TypeError):
        rr_interval(True)


class _Fixed:
    """A fake CSPRNG that returns the given k-bit integers in turn."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)

    def getrandbits(self, k: int) -> int:
        return self.values.pop(0) % (1 << k)


@pytest.mark.parametrize("p", [0.0, 1.0, 0.5, 0.375, 0.1, 2.0**-20 * 3, 1 - 2.0**-12, 1 / 3])
def test_bernoulli_is_exact_for_a_float(p: float) -> None:
    """P[True] = #{r < n} / 2**k = n / 2**k = p: the coin is True exactly for the n smallest k-bit integers
    (checked at the boundary r = n - 1, n, and by enumeration when 2**k is small)."""
    n, den = Fraction(p).as_integer_ratio()
    k = den.bit_length() - 1
    if n >= 1 and k:
        assert bernoulli(p, _Fixed([n - 1]))  # type: ignore[arg-type] - a fake generator
    if n < den and k:
        assert not bernoulli(p, _Fixed([n]))  # type: ignore[arg-type] - a fake generator
    if k <= 16:
        rng = _Fixed(list(range(1 << k)))
        hits = sum(bernoulli(p, rng) for _ in range(1 << k))  # type: ignore[arg-type] - a fake generator
        assert Fraction(hits, 1 << k) == Fraction(p)


def test_bernoulli_frequency_and_bad_probabilities() -> None:
    rng = _rng(1)
    n = 20000
    freq = sum(bernoulli(0.3, rng) for _ in range(n)) / n
    assert abs(freq - 0.3) < 5 * math.sqrt(0.21 / n)
    for bad in (-0.1, 1.5, math.nan, 1):
        with pytest.raises(ValueError, match="probability"):
            bernoulli(bad, rng)  # type: ignore[arg-type] - the int is the point


# -- directions and the L2 clip -------------------------------------------------------------------------------

def test_directions_are_unit_deterministic_from_a_seed_and_centred() -> None:
    seed = bytes(range(32))
    z = direction_from_seed(seed, 7)
    assert z.shape == (7,) and math.isclose(float(np.linalg.norm(z)), 1.0, rel_tol=1e-12)
    np.testing.assert_array_equal(z, direction_from_seed(seed, 7))
    assert not np.array_equal(z, direction_from_seed(bytes(32), 7))
    v = directions(20000, 3, _rng(2))
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-12)
    # uniform on the sphere: mean 0 and E[v v^T] = I/3 (5 standard errors)
    assert np.all(np.abs(v.mean(axis=0)) < 5 * math.sqrt(1 / 3 / 20000))
    np.testing.assert_allclose(v.T @ v / 20000, np.eye(3) / 3, atol=0.02)
    with pytest.raises(ValueError, match="32 bytes"):
        direction_from_seed(b"short", 3)


def test_clip_l2_keeps_direction_and_bounds_the_norm() -> None:
    x = np.array([3.0, 4.0])
    np.testing.assert_allclose(clip_l2(x, 1.0), [0.6, 0.8])
    np.testing.assert_array_equal(clip_l2(x, 10.0), x)
    big = np.full(10, 1e300)
    assert float(np.linalg.norm(clip_l2(big, 2.0))) <= 2.0
    np.testing.assert_array_equal(clip_l2(np.zeros(3), 1.0), np.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        clip_l2(np.array([1.0, math.nan]), 1.0)


# -- duchi ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps0", [0.1, 1.0, 4.0, 64.0])
def test_duchi_bit_ratio_is_within_e_eps0_for_any_two_inputs_given_z(eps0: float) -> None:
    """Exact: the output is (seed, bit); the seed's law is data-free, and given the seed P[bit = 1] is a float in
    [p_lo, p_hi] for ANY input (the extremes +-C z, the zero vector, norms beyond C, the clamp's edge)."""
    mech = DuchiMechanism(eps0, 2.0, rng=_rng(3))
    d = 6
    z = direction_from_seed(bytes(range(32)), d)
    other = direction_from_seed(bytes(32), d)
    inputs = [2.0 * z, -2.0 * z, 5.0 * z, np.zeros(d), 1e-300 * z, 2.0 * other, 1.999999 * z, -1e9 * other]
    probs = [mech.flip_probability(mech.projection(clip_l2(g, 2.0), z)) for g in inputs]
    # the clamp: anything the float arithmetic can produce, including overshoot and non-finite values
    probs += [mech.flip_probability(x) for x in (-1.0, 1.0, 1.0 + 1e-15, -1.0 - 1e-15, 3.0, math.inf, math.nan)]
    assert mech.flip_probability(1.0) == mech.p_hi and mech.flip_probability(-1.0) >= mech.p_lo
    e = _e(eps0)
    for a in probs:
        for b in probs:
            fa, fb = Fraction(a), Fraction(b)
            assert fa / fb <= e and (1 - fa) / (1 - fb) <= e
    # the extremes reach the interval's ends (the low end up to the ulp by which 1 - p_hi may exceed p_lo)
    assert max(probs) == mech.p_hi and mech.p_lo <= min(probs) <= mech.p_lo + 1e-15


def test_duchi_mean_abs_coordinate() -> None:
    assert mean_abs_coordinate(1) == pytest.approx(1.0)
    assert mean_abs_coordinate(2) == pytest.approx(2 / math.pi)
    assert mean_abs_coordinate(3) == pytest.approx(0.5)
    assert mean_abs_coordinate(10_000) == pytest.approx(math.sqrt(2 / (math.pi * 10_000)), rel=1e-4)


def test_duchi_decodes_unbiasedly() -> None:
    """Mean of n decoded reports vs the clipped input: every report has ||g_hat|| = s, so each coordinate's
    standard error is at most s / sqrt(n); the tolerance is 5 of them."""
    d, n, clip = 4, 20000, 1.5
    mech = DuchiMechanism(1.0, clip, rng=_rng(4))
    g = np.array([0.6, -0.3, 0.0, 0.2])  # ||g|| < C: the norm enters through the bit's bias
    total = np.zeros(d)
    for _ in range(n):
        total += mech.decode(mech.randomize(g), d)
    s = mech.scale(d)
    assert np.all(np.abs(total / n - g) < 5 * s / math.sqrt(n)), (total / n, g)
    # a clipped input: the estimate is of the clipped vector
    big = np.array([10.0, 0.0, 0.0, 0.0])
    total = sum(mech.decode(mech.randomize(big), d) for _ in range(n))
    assert np.all(np.abs(total / n - clip_l2(big, clip)) < 5 * s / math.sqrt(n))


def test_duchi_report_length_and_malformed_reports() -> None:
    mech = DuchiMechanism(2.0, 1.0, rng=_rng(5))
    for x in (np.zeros(9), np.full(9, 1e200), np.arange(9.0)):
        report = mech.randomize(x)
        assert len(report) == mech.report_length(9) == 53
    report = bytearray(mech.randomize(np.ones(9)))
    with pytest.raises(ReportError, match="dimension"):
        mech.decode(bytes(report), 10)
    bad = bytearray(report)
    bad[-1] = 2
    with pytest.raises(ReportError, match="bit"):
        mech.decode(bytes(bad), 9)
    with pytest.raises(ReportError, match="magic"):
        mech.decode(b"SDPR" + bytes(report[4:]), 9)
    with pytest.raises(ReportError, match="length"):
        mech.decode(bytes(report) + b"\x00", 9)
    assert "duchi-l2(d=9,C=1,eps0=2)" == mech.label(9)


# -- privunit2 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps0,d", [(0.46, 20), (2.02, 110), (8.0, 650)])
def test_privunit_parameters_keep_the_budget_and_the_cap_mass(eps0: float, d: int) -> None:
    par = privunit_params(eps0, d)
    assert par.eps_used <= eps0
    # the density ratio p (1 - A) / ((1 - p) A) at the cap's exact mass (mpmath) stays below e^eps0
    a = mpmath.betainc((d - 1) / 2, 0.5, 0, 1 - mpmath.mpf(par.gamma) ** 2, regularized=True) / 2
    assert math.isclose(float(a), par.cap, rel_tol=1e-9)
    ratio = mpmath.mpf(par.p) * (1 - a) / ((1 - mpmath.mpf(par.p)) * a)
    assert ratio <= mpmath.e ** mpmath.mpf(eps0)


def test_privunit_cap_mass_matches_monte_carlo() -> None:
    d, gamma, n = 5, 0.3, 40000
    v = directions(n, d, _rng(6))
    share = float(np.mean(v[:, 0] >= gamma))
    a = cap_mass(gamma, d)
    assert abs(share - a) < 5 * math.sqrt(a * (1 - a) / n)
    assert cap_mass(-gamma, d) == pytest.approx(1 - a)


def test_privunit_any_input_ratio_statistically() -> None:
    """Two antipodal unit inputs u, -u (the worst pair: ||g|| = C, so the sign rounding is deterministic) and the
    histogram of t = <out, u> in 8 bins. PrivUnit2's density ratio is e^eps_used between the cap and the rest, so
    every bin's frequency ratio must be at most e^eps0, up to sampling error: the tolerance is 5 standard errors of
    the log frequency ratio, sqrt(1/k1 + 1/k2) for counts k1, k2 (delta method)."""
    eps0, d, n, clip = 1.0, 6, 30000, 1.0
    mech = PrivUnit2Mechanism(eps0, clip, rng=_rng(7))
    par = mech.params(d)
    u = np.zeros(d)
    u[0] = 1.0

    def t_values(x: np.ndarray) -> np.ndarray:
        return np.array([mech.decode(mech.randomize(x), d)[0] * par.m / clip for _ in range(n)])

    t_plus, t_minus = t_values(u), t_values(-u)
    edges = np.array([-1.0, -0.6, -0.3, -par.gamma, 0.0, par.gamma, 0.3, 0.6, 1.0 + 1e-9])
    k1, _ = np.histogram(t_plus, edges)
    k2, _ = np.histogram(t_minus, edges)
    assert np.all(k1 > 200) and np.all(k2 > 200)
    log_ratio = np.abs(np.log(k1 / k2))
    assert np.all(log_ratio <= eps0 + 5 * np.sqrt(1 / k1 + 1 / k2)), (log_ratio, k1, k2)
    # and the cap indicator has the designed law: P[t >= gamma | u] = p, P[t >= gamma | -u] = (1 - p) A / (1 - A)
    in_cap = float(np.mean(t_plus >= par.gamma))
    assert abs(in_cap - par.p) < 5 * math.sqrt(par.p * (1 - par.p) / n)
    other = (1 - par.p) * par.cap / (1 - par.cap)
    assert abs(float(np.mean(t_minus >= par.gamma)) - other) < 5 * math.sqrt(other * (1 - other) / n)


def test_privunit_decodes_unbiasedly() -> None:
    """Each report has ||g_hat|| = C / m, so each coordinate's standard error is at most C / (m sqrt(n))."""
    d, n, clip = 5, 20000, 2.0
    mech = PrivUnit2Mechanism(2.0, clip, rng=_rng(8))
    g = np.array([0.8, -0.4, 0.0, 0.3, -0.1])
    total = np.zeros(d)
    for _ in range(n):
        total += mech.decode(mech.randomize(g), d)
    bound = 5 * clip / mech.params(d).m / math.sqrt(n)
    assert np.all(np.abs(total / n - g) < bound), (total / n, g, bound)


def test_privunit_report_length_and_malformed_reports() -> None:
    mech = PrivUnit2Mechanism(4.0, 1.0, rng=_rng(9))
    for x in (np.zeros(12), np.full(12, -1e200), np.arange(12.0)):
        assert len(mech.randomize(x)) == mech.report_length(12) == 20 + 4 * 12
    report = mech.randomize(np.ones(12))
    body = np.frombuffer(report, dtype="<f4", offset=20).copy()
    with pytest.raises(ReportError, match="norm"):
        mech.decode(report[:20] + (5 * body).astype("<f4").tobytes(), 12)
    body[3] = np.inf
    with pytest.raises(ReportError, match="non-finite"):
        mech.decode(report[:20] + body.tobytes(), 12)
    with pytest.raises(ValueError, match="at least 2 coordinates"):
        mech.randomize(np.ones(1))
    assert mech.label(12).startswith("privunit2-l2(d=12,C=1,eps0=4,p=")


# -- the one interface ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MECHANISMS)
def test_every_mechanism_has_the_interface_and_draws_from_its_csprng(name: str) -> None:
    def build(tag: int) -> Mechanism:
        return make_mechanism(name, eps0=2.0, clip_l1=1.0, clip_l2=1.0, rng=_rng(tag))

    mech = build(10)
    assert isinstance(mech, Mechanism) and mech.name == name
    x = np.linspace(-1, 1, 16)
    report = mech.randomize(x)
    assert len(report) == mech.report_length(16)
    assert mech.decode(report, 16).shape == (16,)
    assert build(11).randomize(x) == build(11).randomize(x)  # everything random comes from the rng
    fresh = make_mechanism(name, eps0=2.0, clip_l1=1.0, clip_l2=1.0)
    assert fresh.randomize(x) != fresh.randomize(x)  # a default rng is keyed from os.urandom


def test_make_mechanism_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="must be one of laplace, duchi, privunit2"):
        make_mechanism("gaussian", eps0=1.0, clip_l1=1.0)
    with pytest.raises(ValueError, match="needs clip-l2"):
        make_mechanism("duchi", eps0=1.0, clip_l1=1.0)
    with pytest.raises(ValueError, match="needs clip-l1"):
        make_mechanism("laplace", eps0=1.0, clip_l2=1.0)
    with pytest.raises(ValueError, match="no grid"):
        make_mechanism("privunit2", eps0=1.0, clip_l2=1.0, log2_grid=-10)
    with pytest.raises(ValueError, match="eps0 must be <= 64"):
        make_mechanism("duchi", eps0=65.0, clip_l2=1.0)
    with pytest.raises(ValueError, match="clip_l2 must be finite and > 0"):
        make_mechanism("duchi", eps0=1.0, clip_l2=-1.0)
