"""Central evaluation on the test split, and the initial model.

Evaluation happens on the server only: federated evaluation would send per-node metrics back next to the
node's id, outside the shuffle. The test split never reaches a client (the clients hold partitions of the
training split, :func:`shuffledp.clients.data.load_partition`), and nothing is fitted on it: the PCA basis and the
scaling come from the public split (:class:`shuffledp.clients.data.Dataset`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shuffledp.server.config import ServerConfig

__all__ = ["CentralEvaluator"]


class CentralEvaluator:
    """The configured dataset's test split, the configured model, and ``evaluate(arrays) -> (loss, accuracy)``.

    The dataset is loaded with the run's seed, the one the clients' partitions are drawn with, so the splits are
    the same on both sides and no client row is in the server's public or test split.
    """

    def __init__(self, cfg: ServerConfig) -> None:
        import torch

        from shuffledp.clients.data import load_data

        # The evaluation is tiny; torch's default intra-op thread pool only spins against the simulated clients
        # on a small machine (measured: a 650-parameter model's backward pass went from ~3 ms to ~55 ms).
        torch.set_num_threads(1)
        self.cfg = cfg
        pca = cfg.pca_components if cfg.pca_components > 0 else None
        self.dataset = load_data(cfg.dataset, data_dir=cfg.data_dir or None, pca_components=pca,
                                 seed=cfg.seed)

    def initial_arrays(self) -> list[np.ndarray]:
        """The round-1 model: ``shuffledp.clients.models.initial_arrays`` for the configured model and data shape,
        initialised with the run's ``seed``."""
        from shuffledp.clients.models import initial_arrays

        ds = self.dataset
        return initial_arrays(self.cfg.model, ds.n_features, ds.n_classes, hidden=self.cfg.hidden_units,
                              seed=self.cfg.seed)

    def evaluate(self, arrays: Sequence[np.ndarray]) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on the test split (reported only)."""
        from shuffledp.clients.models import evaluate

        return evaluate(arrays, self.dataset.x_test, self.dataset.y_test)
