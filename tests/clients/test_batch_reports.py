"""The batch report paths are the apps' report paths: ``randomize`` and ``decode`` are the batch methods on a batch of
one; a batch gives, row by row, what the clients' single path gives for the same CSPRNG stream (byte for byte where
the stream is consumed client after client: duchi; from the same noise draw: laplace; from coins and proposals that
satisfy the mechanism's definition: privunit2); clipping, decoding and refusals are row-wise identical."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from shuffledp.clients.coins import bernoulli, bernoulli_words, coin_words, rr_interval
from shuffledp.clients.core import payload_from_update, payloads_from_updates
from shuffledp.clients.mechanism import MECHANISMS, make_mechanism
from shuffledp.clients.noise import ChaCha20Rng, DiscreteLaplaceSampler
from shuffledp.clients.randomizer import clip_l1, clip_l1_rows
from shuffledp.clients.report import ReportError, encode_report, read_reports
from shuffledp.clients.sphere import (
    clip_l2,
    clip_l2_rows,
    direction_from_seed,
    directions_from_seeds,
    row_norms,
    seed_keystreams,
)
from shuffledp.deploy.inprocess import study_config

KEY = bytes(range(32))
D = 9


def _mech(name: str, rng: ChaCha20Rng | None = None, eps0: float = 2.0):
    return make_mechanism(name, eps0=eps0, clip_l1=1.0, clip_l2=1.0, rng=rng)


def _updates(k: int = 12, d: int = D) -> np.ndarray:
    """Rows inside and outside the clip balls, a zero row, a huge row and one with a single non-zero entry."""
    rows = np.random.default_rng(5).standard_normal((k, d)) * np.linspace(0.01, 3.0, k)[:, None]
    rows[0] = 0.0
    rows[1] = 1e300
    rows[2] = 0.0
    rows[2, 3] = -7.0
    return rows


@pytest.mark.parametrize("name", MECHANISMS)
def test_the_single_report_path_is_the_batch_of_one(name: str) -> None:
    x = _updates()[5]
    single = _mech(name, ChaCha20Rng(KEY)).randomize(x)
    batch = _mech(name, ChaCha20Rng(KEY)).randomize_batch(x.reshape(1, -1))
    assert batch.dtype == np.uint8 and batch.shape == (1, len(single))
    assert batch[0].tobytes() == single
    dec = _mech(name)
    np.testing.assert_array_equal(dec.decode(single, D), dec.decode_batch([single], D).values[0])


@pytest.mark.parametrize("name", MECHANISMS)
def test_decode_batch_rows_are_the_single_decodes(name: str) -> None:
    reports = _mech(name, ChaCha20Rng(KEY)).randomize_batch(_updates())
    dec = _mech(name)
    batch = dec.decode_batch(reports, D)
    assert not batch.refused and batch.values.shape == (len(reports), D)
    for row, report in zip(batch.values, reports):
        np.testing.assert_array_equal(row, dec.decode(report.tobytes(), D))  # bit for bit
    # a sequence of payloads decodes like the array
    np.testing.assert_array_equal(dec.decode_batch([r.tobytes() for r in reports], D).values, batch.values)


def test_duchi_batch_is_byte_for_byte_the_clients_one_at_a_time() -> None:
    """Each client takes a fixed 32 + 8 W bytes of the stream (its seed, its coin), client after client."""
    x = _updates(40)
    for eps0 in (0.5, 2.0, 30.0):  # W = 1, 1, 2 words per coin
        one = _mech("duchi", ChaCha20Rng(KEY), eps0)
        singles = [one.randomize(v) for v in x]
        batch = _mech("duchi", ChaCha20Rng(KEY), eps0).randomize_batch(x)
        assert [row.tobytes() for row in batch] == singles
    assert {r[-1] for r in singles} == {0, 1}


def test_laplace_batch_is_each_clients_quantized_update_plus_one_noise_draw() -> None:
    """Row i = encode(q(x_i) + Z_i): q the single path's quantizer, Z the exact sampler's k * d draws from the same
    stream, in row order."""
    x = _updates()
    mech = _mech("laplace", ChaCha20Rng(KEY))
    rnd = mech.randomizer
    batch = mech.randomize_batch(x)
    noise = DiscreteLaplaceSampler(rnd.noise_num, rnd.noise_log2_den).sample(x.size, ChaCha20Rng(KEY)).reshape(x.shape)
    assert np.abs(noise).max() > 0
    for i, v in enumerate(x):
        q = rnd.quantize(v)
        assert np.abs(q).sum() <= rnd.radius
        want = encode_report(q + noise[i], log2_grid=rnd.log2_grid, eps_used=rnd.eps_used)
        assert batch[i].tobytes() == want
    np.testing.assert_array_equal(rnd.quantize_rows(x), np.stack([rnd.quantize(v) for v in x]))


def test_privunit_batch_outputs_satisfy_the_drawn_coins() -> None:
    """The first 16 bytes per client are its sign and region coins (one word each); every output is a unit vector
    in the region its coin drew, around the sign-rounded direction of its clipped update."""
    x = _updates(30)
    x *= (np.linspace(0.05, 1.5, len(x)) / np.maximum(row_norms(x), 1e-300))[:, None]  # norms about C
    k = len(x)
    mech = _mech("privunit2", ChaCha20Rng(KEY))
    reports = mech.randomize_batch(x)
    par = mech.params(D)
    words = ChaCha20Rng(KEY).random_bytes(16 * k).view(">u8").reshape(k, 2).astype(np.uint64)
    g = clip_l2_rows(x, 1.0)
    norms = np.linalg.norm(g, axis=1)
    keep = bernoulli_words(0.5 + 0.5 * np.minimum(1.0, norms), words[:, :1])
    in_cap = bernoulli_words(np.full(k, par.p), words[:, 1:])
    v = np.frombuffer(reports[:, 20:].tobytes(), dtype="<f4").reshape(k, D).astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    for i in range(k):
        u = g[i] / norms[i] if norms[i] > 0 else np.eye(D)[0]
        t = float(v[i] @ (u if keep[i] else -u))
        assert (t >= par.gamma - 1e-6) if in_cap[i] else (t < par.gamma + 1e-6), (i, t, par.gamma, in_cap[i])
    assert 0 < in_cap.sum() < k and 0 < keep.sum() < k  # both branches are exercised


def test_privunit_batch_and_single_paths_have_the_same_law() -> None:
    """The cap indicator's frequency, P[<V, u> >= gamma] for ||g|| = C, is p on both paths (5 standard errors)."""
    n, d = 4000, 6
    g = np.zeros(d)
    g[0] = 1.0
    mech = _mech("privunit2")
    par = mech.params(d)
    batch = np.frombuffer(mech.randomize_batch(np.tile(g, (n, 1)))[:, 20:].tobytes(), dtype="<f4").reshape(n, d)
    single = np.stack([np.frombuffer(mech.randomize(g)[20:], dtype="<f4") for _ in range(n)])
    se = 5 * math.sqrt(par.p * (1 - par.p) / n)
    for v in (batch, single):
        assert abs(float(np.mean(v[:, 0] >= par.gamma)) - par.p) < se


def test_clipping_rows_is_clipping_each_row() -> None:
    x = np.vstack([_updates(), np.array([[1e308, -1e308] + [1e308] * (D - 2)])])
    for c in (1e-3, 1.0, 5.0):
        np.testing.assert_array_equal(clip_l1_rows(x, c), np.stack([clip_l1(v, c) for v in x]))
        np.testing.assert_array_equal(clip_l2_rows(x, c), np.stack([clip_l2(v, c) for v in x]))
        assert np.all(np.abs(clip_l1_rows(x, c)).sum(axis=1) <= c)
    inside = x[3:4] * 1e-9
    np.testing.assert_array_equal(clip_l1_rows(inside, 1.0), inside)  # inside the ball: unchanged
    with pytest.raises(ValueError, match="non-finite"):
        clip_l1_rows(np.array([[1.0, np.nan]]), 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        clip_l2_rows(np.array([[1.0, np.inf]]), 1.0)


def test_directions_from_seeds_are_the_single_directions() -> None:
    seeds = np.frombuffer(os.urandom(32 * 50), dtype=np.uint8).reshape(50, 32)
    for d in (1, 2, 7, 210):
        z = directions_from_seeds(seeds, d)
        np.testing.assert_array_equal(z, np.stack([direction_from_seed(s.tobytes(), d) for s in seeds]))
        np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, rtol=1e-12)


def test_seed_keystreams_are_rfc8439_chacha20() -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    seeds = np.frombuffer(os.urandom(32 * 5), dtype=np.uint8).reshape(5, 32)
    got = seed_keystreams(seeds, 1000)
    for row, seed in zip(got, seeds):
        enc = Cipher(algorithms.ChaCha20(seed.tobytes(), b"shuffledp-dir\x00\x00\x00"), mode=None).encryptor()
        assert row.tobytes() == enc.update(bytes(1000))


class _Replay:
    """A fake generator replaying 64-bit words: getrandbits(k) reads ceil(k / 64) of them, big-endian."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = [int(w) for w in words]

    def getrandbits(self, k: int) -> int:
        n = -(-k // 64)
        v = 0
        for _ in range(n):
            v = (v << 64) | self.words.pop(0)
        return v >> (64 * n - k)


def test_batch_coins_are_the_exact_coin() -> None:
    """bernoulli_words(p, words) is bernoulli(p) on the same bits, for probabilities of every exponent, including
    the boundary words (the coin's threshold itself and its neighbours)."""
    rng = np.random.default_rng(3)
    for width in (1, 2, 3):
        p = np.minimum(rng.uniform(0, 1, 3000) * 2.0 ** rng.integers(-(64 * width - 60), 1, 3000), 1.0)
        p[:4] = [0.0, 1.0, 0.5, 2.0 ** -(64 * width - 53)]
        words = rng.integers(0, 2**64, (p.size, width), dtype=np.uint64)
        for i in range(4, 60):  # R = N - 1, N, N + 1 for the threshold N = p 2**(64 W)
            n = int(float(p[i]) * 2.0 ** 60) * 2 ** (64 * width - 60) + (i % 3) - 1
            words[i] = [(n >> (64 * (width - 1 - j))) % 2**64 for j in range(width)]
        got = bernoulli_words(p, words)
        for i in range(p.size):
            k = (float(p[i]).as_integer_ratio()[1]).bit_length() - 1
            if 0 < k and -(-k // 64) == width:
                assert got[i] == bernoulli(float(p[i]), _Replay(words[i])), (width, i, p[i])  # type: ignore[arg-type] - a replayed word source
        assert 0 < got.sum() < p.size
    assert coin_words(rr_interval(2.0)[0]) == 1 and coin_words(rr_interval(64.0)[0]) == 3
    with pytest.raises(ValueError, match="more than 1 words"):
        bernoulli_words(np.array([2.0**-80]), np.zeros((1, 1), dtype=np.uint64))


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_malformed_report_in_a_batch_is_refused_with_the_single_message(name: str) -> None:
    reports = _mech(name, ChaCha20Rng(KEY)).randomize_batch(_updates(6))
    bad = [r.tobytes() for r in reports]
    bad[1] = b"XXXX" + bad[1][4:]
    bad[3] = bad[3][:-1]
    bad[4] = "text"
    dec = _mech(name)
    batch = dec.decode_batch(bad, D)
    assert sorted(batch.refused) == [1, 3, 4]
    for i in (1, 3):
        with pytest.raises(ReportError) as exc:
            dec.decode(bad[i], D)
        assert batch.refused[i] == str(exc.value)
    assert "must be bytes" in batch.refused[4]
    assert not batch.values[[1, 3, 4]].any() and batch.values[[0, 2, 5]].any()
    np.testing.assert_array_equal(batch.values[5], dec.decode(bad[5], D))
    np.testing.assert_array_equal(batch.ok, [True, False, True, False, False, True])


def test_laplace_batch_refuses_another_grid_and_out_of_range_integers() -> None:
    mech = _mech("laplace", ChaCha20Rng(KEY))
    reports = mech.randomize_batch(_updates(3)).copy()
    reports[0, 5] = np.uint8((int(np.int8(reports[0, 5].view(np.int8))) + 1) % 256)  # another grid exponent
    reports[2, 24:28] = np.frombuffer(np.int32(-(2**31)).tobytes(), dtype=np.uint8)
    got = read_reports(reports, expected_dim=D, expected_log2_grid=mech.expected_log2_grid)
    assert sorted(got.refused) == [0, 2]
    assert "expected" in got.refused[0] and "out of range" in got.refused[2]


def test_payloads_from_updates_is_the_apps_report_path_per_row() -> None:
    """The apps' payload_from_update on each update, from one stream, gives the batch's rows when each call is a
    batch of one; a non-finite update becomes the zero update, as in the apps."""
    arrays = [np.zeros((3, 2), dtype=np.float32), np.zeros(2, dtype=np.float32)]  # 8 parameters
    cfg, pinned = study_config("duchi", 2.0, 1.0)
    x = _updates(5, 8)
    x[2, 1] = np.nan
    rng = ChaCha20Rng(KEY)
    singles = [payload_from_update(arrays, cfg, pinned, v, rng=rng) for v in x]
    batch = payloads_from_updates(arrays, cfg, pinned, x, rng=ChaCha20Rng(KEY))
    assert [r.tobytes() for r in batch] == singles
    stream = ChaCha20Rng(KEY)
    stream.random_bytes(2 * 40)  # the first two clients' seeds and coins (one word each at eps0 = 2)
    assert batch[2].tobytes() == _mech("duchi", stream).randomize(np.zeros(8))  # the NaN update: the zero update
    with pytest.raises(ValueError, match="the model has 8 parameters"):
        payloads_from_updates(arrays, cfg, pinned, np.zeros((2, 7)))
