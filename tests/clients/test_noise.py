"""The CSPRNG and the exact discrete Laplace sampler (clients/noise.py).

Goodness-of-fit tests use a fixed ChaCha20 test key, so they are deterministic; each states its significance
level ALPHA: with a correct sampler, a fresh key would fail such a test with probability ALPHA.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from shuffledp.clients.noise import (
    ChaCha20Rng,
    DiscreteLaplaceSampler,
    _digit_table,
    discrete_laplace_log_pmf,
    geometric_survival_fraction_bounds,
)

ALPHA = 1e-3  # significance level of every goodness-of-fit test below
N = 200_000


def _key(tag: int) -> bytes:
    return bytes([tag]) * 32


def _pmf(k: np.ndarray, num: int, log2_den: int) -> np.ndarray:
    return np.exp(discrete_laplace_log_pmf(k, num, log2_den))


def _chi2_pvalue(samples: np.ndarray, num: int, log2_den: int, max_bins: int = 60) -> float:
    """Chi-square of the sample histogram against the exact pmf; every bin has expected count >= 20,
    the two tails are merged bins whose mass is computed in closed form (not as 1 - sum)."""
    x = num / 2.0**log2_den
    t = math.exp(-x)
    n = samples.size
    # central support: |k| <= kmax with expected count >= 20 per value
    kmax = 0
    while kmax < max_bins and n * _pmf(np.array([kmax + 1]), num, log2_den)[0] >= 20:
        kmax += 1
    ks = np.arange(-kmax, kmax + 1)
    probs = list(_pmf(ks, num, log2_den))
    counts = [int(np.count_nonzero(samples == k)) for k in ks]
    # tails P(Z > kmax) = P(Z < -kmax) = t^(kmax+1) / (1 + t)
    tail = math.exp(-x * (kmax + 1)) / (1.0 + t)
    if n * tail >= 5:
        probs = [tail] + probs + [tail]
        counts = [int(np.count_nonzero(samples < -kmax))] + counts + [int(np.count_nonzero(samples > kmax))]
    else:
        assert np.all(np.abs(samples) <= kmax + 50)
    probs_arr = np.array(probs)
    expected = probs_arr / probs_arr.sum() * n
    return float(stats.chisquare(counts, expected).pvalue)


@pytest.mark.parametrize(
    "num,log2_den",
    [
        (5, 0),  # x = 5: only the top (geometric) table, P(0) ~ 0.99
        (3, 2),  # x = 0.75
        (1, 4),  # x = 1/16: one truncated digit + top
        (3, 7),  # x = 3/128: top digit only, restarts ("255 or more") in 0.25% of draws
        (1, 6),  # x = 1/64: restarts in 1.9% of draws
        (1, 9),  # x = 1/512: one truncated digit + top digit with x = 1/2
    ],
)
def test_sampler_matches_pmf_chi_square(num: int, log2_den: int) -> None:
    rng = ChaCha20Rng(_key(num * 16 + log2_den))
    z = DiscreteLaplaceSampler(num, log2_den).sample(N, rng)
    assert z.dtype == np.int64
    assert _chi2_pvalue(z, num, log2_den) > ALPHA


def test_sampler_large_scale_quantiles_and_low_digits() -> None:
    """Scale 2**21 (the randomizer's regime: two truncated digits and a top digit).

    Bins of |Z| between exact quantiles, and the lowest base-256 digit (near-uniform), chi-square at ALPHA."""
    num, log2_den = 1, 21
    x = num / 2.0**log2_den
    t = math.exp(-x)
    rng = ChaCha20Rng(_key(200))
    s = DiscreteLaplaceSampler(num, log2_den)
    assert s.n_digits == 2
    z = s.sample(N, rng)
    # P(|Z| >= k) = 2 t^k / (1 + t) for k >= 1; edges where this is 0.95, 0.9, ..., 0.05
    levels = np.arange(0.95, 0.0, -0.05)
    edges = np.ceil(np.log(levels * (1 + t) / 2) / -x).astype(np.int64)
    log_surv = math.log(2) - x * edges - math.log1p(t)  # log P(|Z| >= edge), exact closed form
    surv = np.exp(log_surv)
    a = np.abs(z)
    # bin masses without cancellation: 1 - S_0 = -expm1(log S_0); S_i - S_{i+1} = S_i * -expm1(-x (e_{i+1}-e_i))
    masses = np.concatenate(
        [[-math.expm1(log_surv[0])], surv[:-1] * -np.expm1(-x * np.diff(edges)), [surv[-1]]]
    )
    counts = np.concatenate(
        [[np.count_nonzero(a < edges[0])],
         [np.count_nonzero((a >= lo) & (a < hi)) for lo, hi in zip(edges[:-1], edges[1:])],
         [np.count_nonzero(a >= edges[-1])]]
    )
    assert stats.chisquare(counts, masses / masses.sum() * N).pvalue > ALPHA
    # signs balanced and the lowest digit uniform (its exact pmf differs from uniform by < 1e-4 relative)
    assert stats.binomtest(int(np.count_nonzero(z > 0)), int(np.count_nonzero(z != 0))).pvalue > ALPHA
    low = np.bincount((z & 0xFF).astype(np.int64), minlength=256)
    assert stats.chisquare(low).pvalue > ALPHA
    # variance 2t/(1-t)^2 within 5 standard errors (Laplace kurtosis 6 -> se ~ sqrt(5/N) relative)
    var = 2 * t / (1 - t) ** 2
    assert abs(z.var() / var - 1) < 5 * math.sqrt(5 / N)


def test_zero_is_not_double_counted() -> None:
    """P(0) = (1-t)/(1+t); with the (negative, 0) rejection omitted it would be 2(1-t)/(1+t) - ... ."""
    num, log2_den = 1, 0  # x = 1: P(0) = tanh(1/2) = 0.462
    z = DiscreteLaplaceSampler(num, log2_den).sample(N, ChaCha20Rng(_key(7)))
    p0 = math.tanh(0.5)
    assert stats.binomtest(int(np.count_nonzero(z == 0)), N, p0).pvalue > ALPHA


def test_thresholds_match_independent_high_precision() -> None:
    """The stored 80-bit thresholds equal floor(S_l * 2**80) computed independently with mpmath."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    num, log2_den = 3, 9
    x = mpmath.mpf(num) / 2**log2_den
    tab = _digit_table("truncated", num, log2_den, 256)
    geo = _digit_table("geometric", num, log2_den - 8, 256)
    for ell in (1, 2, 17, 128, 255):
        s_trunc = (mpmath.e ** (-x * ell) - mpmath.e ** (-x * 256)) / (1 - mpmath.e ** (-x * 256))
        want = int(mpmath.floor(s_trunc * mpmath.mpf(2) ** 80))
        assert _stored_threshold(tab, ell) == want
        s_geo = mpmath.e ** (-x * 256 * ell)
        assert _stored_threshold(geo, ell) == int(mpmath.floor(s_geo * mpmath.mpf(2) ** 80))


def _stored_threshold(tab, ell: int) -> int:
    """Reconstruct floor(S_l * 2**80) from the guide (top 16 bits) and low64 tables."""
    # top16 of threshold l: the bucket b with base[b] < l <= base[b] + amb[b]
    b = int(np.flatnonzero((tab.base < ell) & (ell <= tab.base + tab.amb))[0])
    return (b << 64) | int(tab.low64[ell])


class _ScriptedRng:
    """Feeds fixed words to the sampler to drive the ambiguous-bucket and tie paths (tests only)."""

    def __init__(self, u16: list[int], u64: list[int], extra: list[int]) -> None:
        self.u16, self.u64, self.extra = list(u16), list(u64), list(extra)

    def uint16(self, n: int) -> np.ndarray:
        out, self.u16 = self.u16[:n], self.u16[n:]
        return np.array(out, dtype=np.uint16)

    def uint64(self, n: int) -> np.ndarray:
        out, self.u64 = self.u64[:n], self.u64[n:]
        return np.array(out, dtype=np.uint64)

    def getrandbits(self, k: int) -> int:
        assert k == 64
        return self.extra.pop(0)


def _brute_outcome(survival_exact, u_lo: Fraction, u_hi: Fraction, n_thr: int) -> int:
    """#{l : U < S_l} for every U in [u_lo, u_hi) (asserting the interval decides it)."""
    count = 0
    for ell in range(1, n_thr + 1):
        lo, hi = survival_exact(ell)
        if u_hi <= lo:
            count += 1
        else:
            assert u_lo >= hi, "test interval does not decide the comparison"
    return count


@pytest.mark.parametrize("extra_word", [0, 2**64 - 1, 2**63])
def test_tie_resolution_is_exact(extra_word: int) -> None:
    """Force U's first 80 bits to equal a threshold exactly; the sampler must draw more bits and decide."""
    num, log2_den = 5, 8  # geometric table with x = 5/256
    tab = _digit_table("geometric", num, log2_den, 256)
    xfrac = Fraction(num, 2**log2_den)
    ell = 3
    t80 = _stored_threshold(tab, ell)
    rng = _ScriptedRng([t80 >> 64], [t80 & (2**64 - 1)], [extra_word])
    got = int(tab.exact(np.array([t80 >> 64], dtype=np.uint16), rng)[0])
    prefix = (t80 << 64) | extra_word
    u_lo, u_hi = Fraction(prefix, 2**144), Fraction(prefix + 1, 2**144)
    want = _brute_outcome(lambda j: geometric_survival_fraction_bounds(xfrac, j, 400), u_lo, u_hi, tab.n_thr)
    assert got == want
    assert got in (ell - 1, ell)
    assert rng.extra == []  # exactly one extra word was drawn


def test_ambiguous_bucket_path_is_exact() -> None:
    """Buckets that hold a threshold are settled with 64 more bits; compare with exact rational bounds."""
    num, log2_den = 5, 8
    tab = _digit_table("geometric", num, log2_den, 256)
    xfrac = Fraction(num, 2**log2_den)
    buckets = np.flatnonzero(tab.amb > 0)[:20]
    words = [0, 1, 2**63, 2**64 - 2, 2**64 - 1, 12345678901234567890]
    for b in buckets:
        for w in words:
            rng = _ScriptedRng([], [w], [])
            got = int(tab.exact(np.array([b], dtype=np.uint16), rng)[0])
            prefix = (int(b) << 64) | w
            u_lo, u_hi = Fraction(prefix, 2**80), Fraction(prefix + 1, 2**80)
            want = _brute_outcome(lambda j: geometric_survival_fraction_bounds(xfrac, j, 200), u_lo, u_hi, tab.n_thr)
            assert got == want


def test_chacha20_rng_keys() -> None:
    a = ChaCha20Rng(_key(1)).random_bytes(64)
    b = ChaCha20Rng(_key(1)).random_bytes(64)
    c = ChaCha20Rng(_key(2)).random_bytes(64)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # unkeyed generators draw their key from os.urandom: two of them differ
    assert not np.array_equal(ChaCha20Rng().random_bytes(32), ChaCha20Rng().random_bytes(32))
    # the stream continues (no reuse of keystream between calls)
    r = ChaCha20Rng(_key(1))
    first, second = r.random_bytes(32), r.random_bytes(32)
    assert np.array_equal(np.concatenate([first, second]), a)
    with pytest.raises(ValueError, match="32 bytes"):
        ChaCha20Rng(b"short")
    with pytest.raises(ValueError, match=">= 0"):
        ChaCha20Rng().random_bytes(-1)


def test_sampler_parameter_validation() -> None:
    with pytest.raises(ValueError, match="num"):
        DiscreteLaplaceSampler(0, 4)
    with pytest.raises(ValueError, match="log2_den"):
        DiscreteLaplaceSampler(1, -1)
    with pytest.raises(ValueError, match="too large"):
        DiscreteLaplaceSampler(1, 60)
    with pytest.raises(ValueError, match="m must be"):
        DiscreteLaplaceSampler(1, 2).sample(-3)
    assert DiscreteLaplaceSampler(1, 2).sample(0).shape == (0,)


def test_log_pmf_normalised_in_log_space() -> None:
    """sum_k P(k) = 1: P(0) + 2 t/(1-t) * P(0) with the tail summed in closed form."""
    for num, log2_den in [(1, 0), (1, 10), (40, 0)]:
        x = num / 2.0**log2_den
        lp0 = float(discrete_laplace_log_pmf(0, num, log2_den))
        # log(total) = lp0 + log(1 + 2 t / (1 - t)) = lp0 + log((1 + t)/(1 - t))
        log_total = lp0 + math.log1p(math.exp(-x)) - math.log(-math.expm1(-x))
        assert abs(log_total) < 1e-12


def test_forked_child_does_not_replay_the_parent_stream() -> None:
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    rng = ChaCha20Rng()
    ctx = mp.get_context("fork")
    parent_r, child_w = ctx.Pipe(duplex=False)

    def child(conn) -> None:
        conn.send(rng.random_bytes(32).tobytes())
        conn.close()

    proc = ctx.Process(target=child, args=(child_w,))
    proc.start()
    from_child = parent_r.recv()
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert from_child != rng.random_bytes(32).tobytes()


def test_concurrent_threads_share_one_stream_without_error_or_overlap() -> None:
    # The randomizer (and its generator) is cached per process; a host running ClientApp calls on threads
    # got RuntimeError('Already borrowed') from the shared encryptor before the lock.
    import threading

    rng = ChaCha20Rng(_key(7))
    outs: list[list[bytes]] = [[], [], []]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(200):
                outs[i].append(rng.random_bytes(1 << 14).tobytes())
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # every call took a disjoint piece of one keystream: together they are exactly its first 3 * 200 * 16 KiB
    got = sorted(b for o in outs for b in o)
    stream = ChaCha20Rng(_key(7)).random_bytes(3 * 200 * (1 << 14)).tobytes()
    want = sorted(stream[i : i + (1 << 14)] for i in range(0, len(stream), 1 << 14))
    assert got == want


def _survival(k: np.ndarray, x: float) -> np.ndarray:
    """P(|Z| >= k) = 2 t^k / (1 + t) for k >= 1 (t = exp(-x)); P(|Z| >= 0) = 1."""
    k = np.asarray(k, dtype=np.float64)
    return np.where(k >= 1, 2.0 * np.exp(-x * k) / (1.0 + math.exp(-x)), 1.0)


def test_sampler_tail_beyond_the_top_digit() -> None:
    """At x = 1/64 the top digit's "255 or more" outcome restarts the draw in 1.9% of draws. The chi-square above
    merges that tail into one bin, so a sampler whose support stopped at 255 (no restart: bounded noise, no pure
    DP) would pass it. Exact binomial tests, each at ALPHA, of |Z| == 255, |Z| >= 256 and
    |Z| >= 510 (expected about 58, 3,690 and 69 of 200,000)."""
    num, log2_den = 1, 6
    x = num / 2.0**log2_den
    a = np.abs(DiscreteLaplaceSampler(num, log2_den).sample(N, ChaCha20Rng(_key(num * 16 + log2_den))))
    s255, s256, s510 = _survival(np.array([255, 256, 510]), x)
    p255 = s255 * -math.expm1(-x)  # S(255) - S(256) without cancellation
    for count, p in ((np.count_nonzero(a == 255), p255), (np.count_nonzero(a >= 256), s256),
                     (np.count_nonzero(a >= 510), s510)):
        assert N * p > 50
        assert stats.binomtest(int(count), N, float(p)).pvalue > ALPHA, (count, N * p)


@pytest.mark.parametrize("log2_den", [15, 21])
def test_sampler_second_digit(log2_den: int) -> None:
    """The second base-256 digit of |Z|, (|Z| >> 8) & 255, against its exact law, where the sampler draws it from
    its own truncated table (two truncated digits from scale 2**15 on): a table with the wrong ratio passes the
    quantile test above. Over each period of 65,536 the law decays by exp(-2) at 2**15 and by
    exp(-1/32) at 2**21 (the randomizer's scale): P(d = j) = sum over blocks m of S(256 j + 65536 m) -
    S(256 j + 256 + 65536 m), summed in closed form."""
    num = 1
    assert DiscreteLaplaceSampler(num, log2_den).n_digits == 2
    x = num / 2.0**log2_den
    t = math.exp(-x)
    z = DiscreteLaplaceSampler(num, log2_den).sample(N, ChaCha20Rng(_key(180 + log2_den)))
    d = ((np.abs(z) >> 8) & 0xFF).astype(np.int64)
    j = np.arange(256)
    # with S(k) = 2 t^k / (1+t) for every k >= 0, the blocks of digit j sum to 2/(1+t) t^(256 j) (1 - t^256) /
    # (1 - t^65536); k = 0 has mass (1-t)/(1+t), not S(0) - S(1) = 2(1-t)/(1+t), so digit 0 loses (1-t)/(1+t)
    probs = 2.0 / (1.0 + t) * np.exp(-x * 256 * j) * math.expm1(-x * 256) / math.expm1(-x * 65536)
    probs[0] -= -math.expm1(-x) / (1.0 + t)
    assert abs(probs.sum() - 1.0) < 1e-12  # the closed form is a distribution
    assert stats.chisquare(np.bincount(d, minlength=256), probs * N).pvalue > ALPHA
