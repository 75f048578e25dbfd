"""``seed`` fixes the simulation's setup (data splits, partition, initial model) and nothing that protects privacy:
noise, client sampling, shuffling and keys come from the CSPRNG whatever the seed, and whatever anyone does to the
global generators of ``random``, numpy and torch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shuffledp.clients.data import load_data, load_partition
from shuffledp.clients.mechanism import MECHANISMS, make_mechanism
from shuffledp.clients.models import initial_arrays


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - the legacy global generator, seeded on purpose: it must not matter
    torch.manual_seed(seed)


def test_the_seed_fixes_the_setup() -> None:
    a, b, c = load_data(seed=1, pca_components=10), load_data(seed=1, pca_components=10), load_data(seed=2,
                                                                                                     pca_components=10)
    assert np.array_equal(a.x_public, b.x_public) and not np.array_equal(a.y_public, c.y_public)
    xa, _ = load_partition(3, 20, seed=1)
    xb, _ = load_partition(3, 20, seed=1)
    xc, _ = load_partition(3, 20, seed=2)
    assert np.array_equal(xa, xb) and not np.array_equal(xa, xc)
    wa, wb, wc = (initial_arrays("mlp", 10, 10, seed=s) for s in (1, 1, 2))
    assert all(np.array_equal(p, q) for p, q in zip(wa, wb)) and not np.array_equal(wa[0], wc[0])


@pytest.mark.parametrize("name", MECHANISMS)
def test_the_noise_does_not_follow_any_seed(name: str) -> None:
    update = np.linspace(-1.0, 1.0, 40) / 40.0
    reports = []
    for _ in range(2):
        _seed_everything(0)
        reports.append(make_mechanism(name, eps0=1.0, clip_l1=1.0, clip_l2=1.0).randomize(update))
    assert reports[0] != reports[1]


def test_client_sampling_and_keys_do_not_follow_any_seed(tmp_path) -> None:
    from shuffledp.server.rounds import sample_nodes
    from shuffledp.shuffler.keys import init_key_directory, load_private_key

    nodes = list(range(1000))
    samples, keys = [], []
    for i in range(2):
        _seed_everything(0)
        samples.append(sample_nodes(nodes, 0.5))
        d = init_key_directory(tmp_path / f"k{i}", 2, k=2)
        keys.append(load_private_key(d.server_hpke_key, "x25519"))
    assert samples[0] != samples[1] and keys[0] != keys[1]
