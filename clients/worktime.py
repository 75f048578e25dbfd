"""Time this device's worst-case local work under its pinned limits, to choose a ``reply-floor`` that covers it.

The server sees when each device replies, and the local work grows with the device's dataset, so a device pins
``reply-floor`` (docs/interfaces.md): no reply leaves before that many seconds. The floor hides the dataset size
only if it covers the work of every request the device accepts. The pinned work limits bound that work: a
``report = "delta"`` request does ``local-epochs`` passes over the local data in minibatches of ``batch-size``,
so at most ``max-local-epochs x ceil(n / min-batch-size)`` SGD steps on a model of at most
``max-model-parameters`` parameters; each step costs a fixed overhead plus work proportional to the minibatch
size times the parameter count (a forward and a backward pass through a logreg or mlp). A gradient request is
one pass over the data: less.

:func:`time_worst_case` measures that on this device, with its own data and settings, end to end as the
ClientApp does it (:func:`shuffledp.clients.core.make_envelope`: train, clip, randomize, encode, seal), for the two
extreme shapes of a model at the parameter limit: an mlp with as many hidden units as fit, and a logreg with as
many output classes as fit. The first repetition in a fresh process also pays one-time costs (importing torch
and its optimizer machinery: about 4 s of a 6 s first run here, against 1.9 s warm, for the default limits on
a quarter of digits), as the first request of a new ClientApp process does. It is a measurement, not a bound: other
shapes of the same size, another load on the device, or a slower moment can take longer, so choose the floor with a
margin above the measured worst.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from shuffledp.clients.core import make_envelope
from shuffledp.clients.messages import TrainConfig
from shuffledp.clients.settings import data_settings_from_configs, pinned_from_configs
from shuffledp.clients.validation import require_int

__all__ = ["worst_case_models", "time_worst_case"]

#: The learning rate of the timed requests: small, so that the timed SGD stays finite (a diverging run is
#: replaced by the zero update and does no less work, but a finite one is what a normal round does).
_TIMED_LR = 1e-3
#: The number of classes the mlp of :func:`worst_case_models` predicts (both bundled datasets have 10).
_MLP_CLASSES = 10


def worst_case_models(n_features: int, max_parameters: int) -> dict[str, list[np.ndarray]]:
    """The two extreme models with at most ``max_parameters`` parameters for ``n_features`` inputs:
    ``"mlp"`` (10 classes, hidden units ``h = (max - 10) // (n_features + 11)``, at least 1) and ``"logreg"``
    (``c = max // (n_features + 1)`` classes, at least 2). Zero-initialised float32 arrays."""
    require_int("n_features", n_features, 1)
    require_int("max_parameters", max_parameters, 1)
    models: dict[str, list[np.ndarray]] = {}
    hidden = (max_parameters - _MLP_CLASSES) // (n_features + 1 + _MLP_CLASSES)
    if hidden >= 1:
        models["mlp"] = [np.zeros((hidden, n_features), np.float32), np.zeros(hidden, np.float32),
                         np.zeros((_MLP_CLASSES, hidden), np.float32), np.zeros(_MLP_CLASSES, np.float32)]
    classes = max_parameters // (n_features + 1)
    if classes >= 2:
        models["logreg"] = [np.zeros((classes, n_features), np.float32), np.zeros(classes, np.float32)]
    if not models:
        raise ValueError(f"no logreg or mlp with {n_features} inputs fits in {max_parameters} parameters")
    return models


def time_worst_case(node_config: Mapping[str, Any], *, repeat: int = 3) -> dict[str, Any]:
    """Measure the worst-case work of one request under the device's pinned limits (module docstring).

    ``node_config``: the device's node config (deployment: it pins ``eps0``, keys, limits and data settings).
    Each model of :func:`worst_case_models` is timed ``repeat`` times with a ``report = "delta"`` request for
    ``max-local-epochs`` epochs in batches of ``min-batch-size``. Returns a JSON-ready dict: the data shape, the
    cold data load time, per model its parameter count, SGD steps and the seconds of each repetition, and
    ``worst_s`` (the slowest repetition plus the cold load: the first request of a SuperNode loads the data),
    ``reply_floor_s`` (pinned) and ``covered`` (``reply_floor_s >= worst_s``). Every number is a measurement
    on this machine, not a bound. Raises :class:`shuffledp.clients.settings.ClientSetupError` for a bad node config.
    """
    require_int("repeat", repeat, 1, 100)
    from shuffledp.clients.data import load_partition

    pinned = pinned_from_configs(node_config, {})
    settings = data_settings_from_configs(node_config, {})
    t0 = time.perf_counter()
    x, y = load_partition(pinned.partition_id, pinned.num_partitions, **settings)
    load_s = time.perf_counter() - t0
    n, n_features = int(x.shape[0]), int(x.shape[1])
    epochs, batch = pinned.max_local_epochs, pinned.min_batch_size
    steps = epochs * math.ceil(n / batch)
    out: dict[str, Any] = {
        "samples": n,
        "features": n_features,
        "load_s": load_s,
        "max_local_epochs": epochs,
        "min_batch_size": batch,
        "max_model_parameters": pinned.max_model_parameters,
        "models": {},
    }
    for kind, arrays in worst_case_models(n_features, pinned.max_model_parameters).items():
        times = []
        for rnd in range(1, repeat + 1):
            cfg = TrainConfig(round=rnd, key_epoch=0, eps0=pinned.eps0, clip_l1=pinned.clip_l1, report="delta",
                              local_epochs=epochs, local_lr=_TIMED_LR, batch_size=batch,
                              mechanism=pinned.mechanism, clip_l2=pinned.clip_l2)
            t = time.perf_counter()
            make_envelope(arrays, cfg, pinned, (x, y))
            times.append(time.perf_counter() - t)
        out["models"][kind] = {
            "shape": ["x".join(str(d) for d in a.shape) for a in arrays],
            "parameters": int(sum(a.size for a in arrays)),
            "steps": steps,
            "seconds": times,
        }
    worst = load_s + max(max(m["seconds"]) for m in out["models"].values())
    out["worst_s"] = worst
    out["reply_floor_s"] = pinned.reply_floor
    out["covered"] = pinned.reply_floor >= worst
    return out
