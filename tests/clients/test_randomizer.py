"""clip_l1 and DiscreteLaplaceRandomizer: the any-input eps0-LDP guarantee, computed exactly."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.randomizer import (
    NOISE_LOG2_DEN,
    DiscreteLaplaceRandomizer,
    clip_l1,
    flatten_arrays,
    unflatten_vector,
)
from shuffledp.clients.report import decode_report_full

# ---------------------------------------------------------------------------------------------------------------
# clipping
# ---------------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, database=None)
@given(
    x=arrays(np.float64, st.integers(1, 50), elements=st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)),
    c=st.floats(1e-6, 1e3),
)
def test_clip_properties(x: np.ndarray, c: float) -> None:
    before = x.copy()
    y = clip_l1(x, c)
    assert np.array_equal(x, before)  # input never mutated
    assert y is not x and y.dtype == np.float64
    assert float(np.abs(y).sum()) <= c  # the bound holds as computed, not just up to rounding
    n = float(np.abs(x).sum())
    if n <= c:
        assert np.array_equal(y, x)  # inside the ball: unchanged
    else:
        # direction kept: y = s * x with one s in (0, 1] (exact up to rounding for normal floats; subnormal
        # results carry fewer significant bits, so they are left out of the ratio check)
        nz = (x != 0) & (np.abs(y) >= np.finfo(np.float64).tiny)
        ratios = y[nz] / x[nz]
        assert np.all(ratios > 0) and np.all(ratios <= 1)
        assert np.allclose(ratios, ratios[0], rtol=1e-12, atol=0)
        assert float(np.abs(y).sum()) >= c * (1 - 1e-12)  # and not shrunk more than needed
    assert np.all(y[x == 0] == 0)


def test_clip_zero_float32_and_overflow() -> None:
    z = np.zeros(7, dtype=np.float32)
    y = clip_l1(z, 1.0)
    assert np.array_equal(y, np.zeros(7)) and not np.shares_memory(y, z)
    x32 = np.array([3.0, -4.0], dtype=np.float32)
    keep = x32.copy()
    y = clip_l1(x32, 1.0)
    assert np.array_equal(x32, keep)
    assert np.allclose(y, [3 / 7, -4 / 7], rtol=1e-12)
    big = np.array([1e308, 1e308, -1e308])  # finite entries whose L1 norm overflows
    y = clip_l1(big, 2.0)
    assert np.isfinite(y).all() and float(np.abs(y).sum()) <= 2.0
    assert np.allclose(y, [2 / 3, 2 / 3, -2 / 3], rtol=1e-9)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_clip_refuses_non_finite(bad: float) -> None:
    x = np.array([1.0, bad, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        clip_l1(x, 1.0)


@pytest.mark.parametrize("c", [0.0, -1.0, math.nan, math.inf])
def test_clip_refuses_bad_bound(c: float) -> None:
    with pytest.raises(ValueError, match="clip must be finite and > 0"):
        clip_l1(np.ones(3), c)
    with pytest.raises(TypeError):
        clip_l1(np.array(["a"]), 1.0)


def test_flatten_round_trip() -> None:
    arrs = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0, 8.0], dtype=np.float32)]
    v = flatten_arrays(arrs)
    assert v.shape == (8,) and v.dtype == np.float64
    back = unflatten_vector(v, arrs)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(arrs, back))
    with pytest.raises(ValueError, match="entries"):
        unflatten_vector(v[:-1], arrs)


# ---------------------------------------------------------------------------------------------------------------
# the any-input guarantee
# ---------------------------------------------------------------------------------------------------------------

SETTINGS = [
    (1.0, 1.0, None),
    (0.5, 10.0, None),
    (8.0, 0.25, None),
    (2.0, 3.0, -4),  # coarse grid: K = 48
    (4.0, 1.0, 0),  # K = 1
    (0.1, 1e-3, None),
]


def _extreme_inputs(r: DiscreteLaplaceRandomizer, d: int) -> list[np.ndarray]:
    c, g = r.clip, r.gamma
    e1 = np.zeros(d)
    e1[0] = 1.0
    spread = np.full(d, c / d)
    # every coordinate just at a rounding half-point, so round-to-nearest overshoots the L1 ball
    half = np.full(d, (math.floor(c / d / g) + 0.5) * g)
    alt = spread * np.where(np.arange(d) % 2 == 0, 1.0, -1.0)
    return [c * e1, -c * e1, 1e9 * e1, spread, -spread, half, -half, alt, np.zeros(d)]


@pytest.mark.parametrize("eps0,clip,grid", SETTINGS)
def test_any_input_worst_case_ratio_exact(eps0: float, clip: float, grid: int | None) -> None:
    """For every pair of extreme inputs, max_y P(y|x)/P(y|x') = exp(s * ||q - q'||_1) <= exp(eps0), exactly.

    s = num / 2**52 is the noise parameter; the comparison is done in exact rationals (log ratios)."""
    r = DiscreteLaplaceRandomizer(eps0, clip, log2_grid=grid)
    s = Fraction(r.noise_num, 2**NOISE_LOG2_DEN)
    assert r.sensitivity == 2 * r.radius
    assert r.eps_used_exact == s * r.sensitivity
    assert r.eps_used_exact <= Fraction(eps0)
    assert Fraction(eps0) - r.eps_used_exact <= Fraction(eps0) * Fraction(1, 2**20)
    assert r.eps_used <= eps0
    for d in (1, 3, 64):
        qs = [r.quantize(x) for x in _extreme_inputs(r, d)]
        for q in qs:
            assert int(np.abs(q).sum()) <= r.radius
        worst = max(int(np.abs(a - b).sum()) for a, b in itertools.combinations(qs, 2))
        assert worst <= 2 * r.radius
        assert s * worst <= Fraction(eps0)
        if d == 1:
            assert worst == 2 * r.radius  # +C e1 vs -C e1 attains the diameter


def test_worst_case_ratio_by_enumeration_small() -> None:
    """Enumerate outputs y in a window for d = 2 and a tiny K: the largest exact log-ratio over y equals
    s * ||q - q'||_1 (so the closed form used above is the true worst case) and is <= eps0."""
    eps0 = 1.5
    r = DiscreteLaplaceRandomizer(eps0, 3.0, log2_grid=0)  # K = 3
    s = Fraction(r.noise_num, 2**NOISE_LOG2_DEN)
    q1 = r.quantize(np.array([3.0, 0.0]))
    q2 = r.quantize(np.array([-1.5, -1.5]))
    best = Fraction(-10**9)
    for y in itertools.product(range(-8, 9), repeat=2):
        y_arr = np.array(y)
        # log P(y|q1) - log P(y|q2) = s * (||y - q2||_1 - ||y - q1||_1): the normalising constants cancel
        lr = s * (int(np.abs(y_arr - q2).sum()) - int(np.abs(y_arr - q1).sum()))
        best = max(best, lr)
    assert best == s * int(np.abs(q1 - q2).sum())
    assert best <= Fraction(eps0)


def test_noise_is_calibrated_to_the_whole_report_not_one_record() -> None:
    """Scale 2C/eps0 (the Algorithm 1 of seed 000, Chen, Cao, Ge, "Rényi DP in the shuffle model: enhanced
    amplification bounds", ICASSP 2024, would use 2C/(m eps0) for m local records: far too little)."""
    eps0, clip = 2.0, 1.0
    r = DiscreteLaplaceRandomizer(eps0, clip, rng=ChaCha20Rng(b"\x09" * 32))
    assert r.noise_scale >= 2 * r.radius * r.gamma / eps0
    assert r.noise_scale == pytest.approx(2 * clip / eps0, rel=1e-5)
    d = 20_000
    y = r.privatize(np.zeros(d)) * r.gamma
    # Laplace(b): std = sqrt(2) b; with b = 2C/eps0 = 1 -> 1.414 (a 2C/(m eps0) calibration would be m x smaller)
    assert np.std(y) == pytest.approx(math.sqrt(2) * 2 * clip / eps0, rel=0.05)


def test_encode_decode_and_post_processing() -> None:
    r = DiscreteLaplaceRandomizer(1.0, 1.0, rng=ChaCha20Rng(b"\x0a" * 32))
    x = np.linspace(-1, 1, 101)
    payload = r.encode(x)
    rep = decode_report_full(payload, expected_dim=101)
    assert rep.log2_grid == r.log2_grid and rep.eps_used == r.eps_used
    assert rep.ints.shape == (101,)
    assert np.array_equal(rep.values, rep.ints.astype(np.float64) * r.gamma)


def test_rounding_cannot_break_the_ball() -> None:
    r = DiscreteLaplaceRandomizer(1.0, 1.0, log2_grid=-4)  # K = 16, grid 1/16
    d = 1000
    # 1000 coordinates of 0.001 are each rounded to 0 but a vector of half-points would round up
    for val in (0.5 / 16, 1.5 / 16, 1e-3):
        q = r.quantize(np.full(d, val))
        assert int(np.abs(q).sum()) <= r.radius


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"eps0": 0.0, "clip_l1": 1.0}, "eps0 must be finite and > 0"),
        ({"eps0": math.inf, "clip_l1": 1.0}, "eps0 must be finite and > 0"),
        ({"eps0": 100.0, "clip_l1": 1.0}, "eps0 must be <= 64"),
        ({"eps0": 1.0, "clip_l1": -2.0}, "clip_l1 must be finite and > 0"),
        ({"eps0": 1.0, "clip_l1": 1.0, "log2_grid": 3}, "K = 0"),
        ({"eps0": 1.0, "clip_l1": 1.0, "log2_grid": -40}, "exceeds 2\\*\\*30"),
        ({"eps0": 1e-4, "clip_l1": 1.0, "log2_grid": -20}, "saturation"),
        ({"eps0": 1.0, "clip_l1": 1.0, "log2_grid": 99}, "log2_grid must be in"),
        # no default grid works: the message names the binding constraint, not the last grid tried (2**20)
        ({"eps0": 1e-9, "clip_l1": 1.0}, r"eps0=1e-09, clip_l1=1.0; at the coarsest grid that still resolves the "
                                         r"clip, 2\*\*0: int32 saturation .*, and every coarser grid is coarser"),
        ({"eps0": 1.0, "clip_l1": 2.0**-70}, r"the grid 2\*\*-60 is coarser than the clip"),
    ],
)
def test_randomizer_refuses_bad_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DiscreteLaplaceRandomizer(**kwargs)


def test_default_grid_coarsens_for_small_eps0_and_reports_it() -> None:
    r = DiscreteLaplaceRandomizer(1e-4, 1.0)
    assert r.log2_grid > -20  # the default rule moved to a coarser grid to keep saturation negligible
    assert r.eps_used <= 1e-4
    assert DiscreteLaplaceRandomizer(1.0, 1.0).log2_grid == -20


def test_released_noise_has_the_claimed_parameter() -> None:
    """The noise actually added, y - q(x), follows the discrete Laplace pmf with t = exp(-num / 2**52) that the
    guarantee is computed from (chi-square at significance ALPHA, fixed test key).

    Coarse grid so the scale is small: eps0 = 1, C = 3, gamma = 1 -> K = 3, scale 2K/eps0 = 6 grid units."""
    from scipy import stats

    from shuffledp.clients.noise import discrete_laplace_log_pmf

    alpha = 1e-3
    r = DiscreteLaplaceRandomizer(1.0, 3.0, log2_grid=0, rng=ChaCha20Rng(b"\x0b" * 32))
    d = 100_000
    x = np.zeros(d)
    x[:3] = [2.0, -0.6, 0.4]
    q = r.quantize(x)
    z = r.privatize(x) - q
    kmax = 40
    ks = np.arange(-kmax, kmax + 1)
    p = np.exp(discrete_laplace_log_pmf(ks, r.noise_num, r.noise_log2_den))
    s = r.noise_num / 2.0**r.noise_log2_den
    tail = math.exp(-s * (kmax + 1)) / (1 + math.exp(-s))  # P(Z > kmax) = P(Z < -kmax), closed form
    probs = np.concatenate([[tail], p, [tail]])
    counts = np.concatenate(
        [[np.count_nonzero(z < -kmax)], [np.count_nonzero(z == k) for k in ks], [np.count_nonzero(z > kmax)]]
    )
    assert stats.chisquare(counts, probs / probs.sum() * d).pvalue > alpha
    # and the scale is 2K/eps0 grid units, i.e. 2C/eps0: var = 2t/(1-t)^2 ~ 2 * 6**2
    assert np.var(z) == pytest.approx(2 * math.exp(-s) / (-math.expm1(-s)) ** 2, rel=0.05)


def test_a_clip_too_large_for_the_report_format_is_refused_at_construction() -> None:
    from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer

    ok = DiscreteLaplaceRandomizer(1.0, 2.0**41 * (1 - 2**-52))
    assert ok.log2_grid == 20 and len(ok.encode(np.zeros(3))) > 0  # the largest clip still encodes
    with pytest.raises(ValueError, match=r"clip_l1 must be < 2\*\*41"):
        DiscreteLaplaceRandomizer(1.0, 2.0**41)
