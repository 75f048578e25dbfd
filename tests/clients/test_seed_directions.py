"""The direction a duchi report's seed stands for: the documented derivation (checked against a plain per-seed
implementation), its law (uniform angle, uniform direction), the block-wise batch path (rows independent of the
block, ``out`` and ``scales``), the block-wise L2 clip, and a report made with another derivation refused."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from shuffledp.clients import sphere
from shuffledp.clients.duchi import DUCHI_MAGIC, DuchiMechanism
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.report import ReportError
from shuffledp.clients.sphere import clip_l2, clip_l2_rows_and_norms, direction_from_seed, directions_from_seeds


def _seeds(k: int, tag: int) -> np.ndarray:
    return ChaCha20Rng(bytes([tag]) * 32).random_bytes(32 * k).reshape(k, 32)


def _reference_direction(seed: bytes, d: int) -> np.ndarray:
    """The derivation as :func:`directions_from_seeds` documents it, one seed at a time."""
    half = (d + 1) // 2
    cipher = Cipher(algorithms.ChaCha20(seed, b"shuffledp-dir\x00\x00\x00"), mode=None)
    stream = cipher.encryptor().update(bytes(16 * half))
    words = struct.unpack(f"<{2 * half}Q", stream)
    a, b = words[0::2], words[1::2]
    u = (np.array([float(w >> 11) for w in a]) + 0.5) * 2.0**-53
    r = np.sqrt(-2.0 * np.log(u))
    t = (np.array([float(w >> 11) for w in b]) - (2.0**52 - 0.5)) * (math.pi * 2.0**-54)
    cos, sin = np.cos(t), np.sin(t)
    normals = []
    for j, w in enumerate(b):
        c, s = cos[j], sin[j]
        if w & 1:
            c = -c
        if w & 2:
            c, s = s, c
        normals += [r[j] * c, r[j] * s]
    z = np.array(normals[:d])
    return z / np.sqrt(np.add.reduce(z * z))


@pytest.mark.parametrize("d", [1, 2, 3, 8, 210])
def test_the_derivation_is_the_documented_one(d: int) -> None:
    seeds = _seeds(40, d)
    got = directions_from_seeds(seeds, d)
    want = np.stack([_reference_direction(s.tobytes(), d) for s in seeds])
    np.testing.assert_array_equal(got, want)


def test_the_four_arcs_tile_the_circle() -> None:
    """Each bit case of a pair puts its point at angle t, pi - t, pi/2 - t or t - pi/2, for t in (-pi/4, pi/4)."""
    top = np.array([0, 1, 2**52 - 1, 2**52, 2**53 - 1, 3 * 2**50], dtype=np.uint64) << np.uint64(11)
    t = (top >> np.uint64(11)).astype(np.float64) - (2.0**52 - 0.5)
    t *= math.pi * 2.0**-54
    assert np.all(np.abs(t) < math.pi / 4)
    for case, angle in enumerate([t, math.pi - t, math.pi / 2 - t, t - math.pi / 2]):
        words = top | np.uint64(case)
        work = sphere._Work(1, 2 * words.size)
        work.quarter_turns(words)
        np.testing.assert_allclose(work.cos[:words.size], np.cos(angle), rtol=0, atol=1e-15)
        np.testing.assert_allclose(work.sin[:words.size], np.sin(angle), rtol=0, atol=1e-15)


def test_the_angle_and_the_direction_are_uniform() -> None:
    n = 40_000
    z = directions_from_seeds(_seeds(n, 1), 2)
    angle = np.sort(np.arctan2(z[:, 1], z[:, 0]) / (2 * math.pi) + 0.5)  # uniform on (0, 1)
    ks = np.max(np.abs(angle - (np.arange(n) + 0.5) / n))
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at the 1% level
    counts = np.histogram(angle, bins=64, range=(0.0, 1.0))[0]  # no arc over- or under-filled
    expected = n / 64
    assert float(np.sum((counts - expected) ** 2 / expected)) < 110  # chi-square, 63 dof: far tail
    v = directions_from_seeds(_seeds(n, 2), 3)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-12)
    assert np.all(np.abs(v.mean(axis=0)) < 5 * math.sqrt(1 / 3 / n))
    np.testing.assert_allclose(v.T @ v / n, np.eye(3) / 3, atol=0.01)


def test_batches_out_and_scales_are_row_wise() -> None:
    d, k = 37, 1000  # several blocks
    seeds = _seeds(k, 3)
    z = directions_from_seeds(seeds, d)
    np.testing.assert_array_equal(z[::97], np.stack([direction_from_seed(s.tobytes(), d) for s in seeds[::97]]))
    np.testing.assert_array_equal(directions_from_seeds(seeds[5:7], d), z[5:7])
    scales = np.linspace(-3.0, 2.0, k)
    out = np.full((k, d), np.nan)
    assert directions_from_seeds(seeds, d, scales=scales, out=out) is out
    np.testing.assert_array_equal(out, scales[:, None] * z)
    assert directions_from_seeds(seeds[:0], d).shape == (0, d)
    with pytest.raises(ValueError, match="out"):
        directions_from_seeds(seeds, d, out=np.empty((k, d + 1)))
    with pytest.raises(ValueError, match="scales"):
        directions_from_seeds(seeds, d, scales=np.ones(k + 1))


def test_the_blockwise_clip_is_row_wise() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3000, 41)) * rng.exponential(2.0, (3000, 1))  # several blocks, rows in and out
    x[10] = 0.0
    x[11] = 1e300
    for c in (1.0, 0.37):
        out, norms = clip_l2_rows_and_norms(x, c)
        np.testing.assert_array_equal(out, np.stack([clip_l2(row, c) for row in x]))
        np.testing.assert_array_equal(norms, sphere.row_norms(out))
        assert np.all(norms <= c)
    bad = x.copy()
    bad[2500, 3] = np.inf
    bad[7, 0] = np.nan
    with pytest.raises(ValueError, match="2 non-finite"):
        clip_l2_rows_and_norms(bad, 1.0)


def test_a_report_of_another_derivation_is_refused() -> None:
    """``SDPD`` names the derivation with the angle ``2 pi u``: its seeds stand for other directions."""
    mech = DuchiMechanism(2.0, 1.0, rng=ChaCha20Rng(bytes(32)))
    report = mech.randomize(np.ones(9))
    assert report[:4] == DUCHI_MAGIC == b"SDD2"
    with pytest.raises(ReportError, match="magic"):
        mech.decode(b"SDPD" + report[4:], 9)
