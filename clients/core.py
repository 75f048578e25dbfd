"""The client's reusable core, independent of Flower's runtime.

Signature (what the ClientApp's mod and the server's tests with a fake Grid call)::

    make_envelope(arrays: Sequence[np.ndarray], config: TrainConfig | Mapping[str, Any],
                  pinned: PinnedSettings, data: tuple[np.ndarray, np.ndarray] | None = None, *,
                  rng: ChaCha20Rng | None = None, update: np.ndarray | None = None) -> bytes

* ``arrays``: the model as received (numpy arrays in parameter order; logreg or mlp, see shuffledp.clients.models);
* ``config``: the request's ``content["config"]`` (parsed with :meth:`TrainConfig.from_mapping`);
* ``pinned``: the client's own settings (:class:`PinnedSettings`; build it with :func:`pinned_from_configs`
  from ``context.node_config`` / ``context.run_config``, or directly in tests);
* ``data``: the client's partition ``(x, y)``: the report is computed here (:func:`compute_update`); or
* ``update``: instead of ``data``, the report computed elsewhere (a flat vector of the model's size: what
  :mod:`shuffledp.clients.mod` derives from a wrapped ClientApp's updated model).

It raises :class:`shuffledp.clients.messages.RequestError` for a malformed request and :class:`PinnedMismatchError` when
the request's mechanism, eps0 or clip differ from the pinned values (the server is the adversary: the client never lets
it choose its privacy parameters) or it asks for more local work than the pinned work limits allow
(:func:`check_pinned`). Those decisions never depend on the data (see :func:`make_payload`: a local
computation that fails is reported as the zero update). Otherwise it returns the envelope: the report computed
at ``arrays`` (average gradient, or model delta after E local epochs), clipped and randomized by the pinned
mechanism (:mod:`shuffledp.clients.mechanism`: by default L1 ``clip_l1`` and the exact discrete Laplace mechanism;
each is eps0-LDP for any two inputs), encoded as its fixed-length report, and sealed
with ``shuffledp.shuffler.envelope.seal`` (inner to the server key, outer to the pinned shuffler key, binding round id,
key epoch and ``arrays_digest(arrays)``, signed with the client key).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shuffledp.clients.mechanism import Mechanism, make_mechanism
from shuffledp.clients.messages import RequestError, TrainConfig, arrays_digest
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.randomizer import flatten_arrays
from shuffledp.clients.settings import PinnedSettings, check_pinned

__all__ = [
    "compute_update",
    "check_model_fits_data",
    "local_model",
    "make_payload",
    "payload_from_update",
    "payloads_from_updates",
    "make_envelope",
]

_log = logging.getLogger("shuffledp.client")


def compute_update(arrays: Sequence[np.ndarray], cfg: TrainConfig, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The unclipped report as one flat float64 vector: the average gradient of the local loss at ``arrays``
    (``cfg.report == "gradient"``) or the model delta after ``cfg.local_epochs`` epochs (``"delta"``)."""
    from shuffledp.clients.models import average_gradient, local_delta

    if cfg.report == "gradient":
        parts = average_gradient(arrays, x, y)
    else:
        parts = local_delta(arrays, x, y, epochs=cfg.local_epochs, lr=cfg.local_lr, batch_size=cfg.batch_size)
    return flatten_arrays(parts)


def check_model_fits_data(arrays: Sequence[np.ndarray], x: np.ndarray) -> None:
    """The request checks that need the model: it is a logreg or mlp with finite parameters
    (:func:`shuffledp.clients.models.model_from_arrays`), and its input width is the data's feature count (a property of
    the dataset, not of any record). Raises :class:`RequestError`."""
    from shuffledp.clients.models import model_from_arrays

    try:
        model_from_arrays(arrays)
    except ValueError as exc:
        raise RequestError(f"the model cannot be used: {exc}") from None
    width = int(np.asarray(arrays[0]).shape[1])
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != width:
        # the feature count only: the number of rows is the client's dataset size, which this reply (sent
        # whenever the server asks with a model of the wrong width) must not carry
        found = f"{x.shape[1]} features" if x.ndim == 2 else "no 2-D feature matrix"
        raise RequestError(f"the model takes {width} features; this client's data has {found}")


def _parse(
    config: TrainConfig | Mapping[str, Any], pinned: PinnedSettings, arrays: Sequence[np.ndarray]
) -> TrainConfig:
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_mapping(config)
    check_pinned(cfg, pinned, _n_parameters(arrays))
    return cfg


def _mechanism(pinned: PinnedSettings, rng: ChaCha20Rng | None) -> Mechanism:
    if rng is None:
        return pinned.local_mechanism()
    return make_mechanism(pinned.mechanism, eps0=pinned.eps0, clip_l1=pinned.clip_l1, clip_l2=pinned.clip_l2,
                          log2_grid=pinned.log2_grid, rng=rng)


def _n_parameters(arrays: Sequence[np.ndarray]) -> int:
    return sum(int(np.asarray(a).size) for a in arrays)


def make_payload(
    arrays: Sequence[np.ndarray],
    config: TrainConfig | Mapping[str, Any],
    pinned: PinnedSettings,
    data: tuple[np.ndarray, np.ndarray],
    *,
    rng: ChaCha20Rng | None = None,
) -> bytes:
    """The encoded report (before sealing): compute, clip, randomize, encode.

    Whether this returns or raises never depends on the client's data. Every check that can refuse a request
    (config, pinned values, model shape and finiteness, feature count) runs before the data is used. After
    that, a computation that fails or produces non-finite values (a model chosen so that the logits overflow
    for some inputs only, a learning rate that makes local SGD diverge on some data) is replaced by the zero
    update, which is then clipped and randomized like any other. An error reply there would reach the server
    outside the mechanism, from a known node, with P[error | x] in {0, 1}: an infinite privacy loss that
    shuffling cannot hide. The report stays eps0-LDP because any function of the data followed by the
    mechanism is (post-processing of the input side). Such a substitution is logged on the client only, by
    exception type.
    """
    cfg = _parse(config, pinned, arrays)
    if len(arrays) == 0:
        raise RequestError("the request carries no model arrays")
    x, y = data
    check_model_fits_data(arrays, x)
    rnd = _mechanism(pinned, rng)
    try:
        vec = compute_update(arrays, cfg, x, y)
        failure = None if np.all(np.isfinite(vec)) else "non-finite values"
    except Exception as exc:  # noqa: BLE001 - data-dependent failures must not change the reply (docstring)
        failure = type(exc).__name__
    if failure is not None:
        _log.warning("the local update failed (%s); reporting the zero update, randomized as usual", failure)
        vec = np.zeros(_n_parameters(arrays), dtype=np.float64)
    return rnd.randomize(vec)


def payloads_from_updates(
    arrays: Sequence[np.ndarray],
    config: TrainConfig | Mapping[str, Any],
    pinned: PinnedSettings,
    updates: np.ndarray,
    *,
    rng: ChaCha20Rng | None = None,
) -> np.ndarray:
    """The encoded reports of k updates computed elsewhere: clip, randomize, encode, one report per row (the
    pinned mechanism's ``randomize_batch``). What :func:`payload_from_update` does for one client, for k clients at
    once (in-process studies); a non-finite update is replaced by the zero update, as in :func:`make_payload`.

    Args:
        arrays: the model as received (each update must have as many entries as it has parameters).
        config: the request's config.
        pinned: the clients' pinned settings (checked against the config).
        updates: the unclipped reports, real ``(k, parameters)``.
        rng: the CSPRNG of the noise; default, the pinned randomizer's (keyed from ``os.urandom``).

    Returns:
        uint8 ``(k, report length)``: row i is the payload of ``updates[i]`` (``shuffledp.clients.report``).

    Raises:
        RequestError: a malformed config.
        PinnedMismatchError: the config asks for other values than the pinned ones.
        ValueError: the updates do not have the model's size or are not a real array.
    """
    _parse(config, pinned, arrays)
    n = _n_parameters(arrays)
    vecs = np.asarray(updates)
    if vecs.dtype.kind not in "fiu":
        raise ValueError(f"the update must be a real array, got dtype {vecs.dtype}")
    if vecs.ndim != 2 or vecs.shape[1] != n or n == 0:
        raise ValueError(f"the update has {vecs.shape[-1] if vecs.ndim else vecs.size} entries; "
                         f"the model has {n} parameters")
    vecs = vecs.astype(np.float64)
    finite = np.isfinite(vecs).all(axis=1)
    if not finite.all():
        _log.warning("%d local updates have non-finite values; reporting the zero update, randomized as usual",
                     int(np.count_nonzero(~finite)))
        vecs[~finite] = 0.0
    return _mechanism(pinned, rng).randomize_batch(vecs)


def payload_from_update(
    arrays: Sequence[np.ndarray],
    config: TrainConfig | Mapping[str, Any],
    pinned: PinnedSettings,
    update: np.ndarray,
    *,
    rng: ChaCha20Rng | None = None,
) -> bytes:
    """The encoded report of an update computed elsewhere: clip, randomize, encode (:func:`payloads_from_updates`
    on one update).

    A non-finite update is replaced by the zero update (logged on the client only), as in :func:`make_payload`.

    Args:
        arrays: the model as received (the update must have as many entries as it has parameters).
        config: the request's config.
        pinned: the client's pinned settings (checked against the config).
        update: the unclipped report, any shape, as many entries as the model has parameters.
        rng: the CSPRNG of the noise; default, the pinned randomizer's (keyed from ``os.urandom``).

    Returns:
        The fixed-length report payload (``shuffledp.clients.report``).

    Raises:
        RequestError: a malformed config.
        PinnedMismatchError: the config asks for other values than the pinned ones.
        ValueError: the update does not have the model's size or is not a real array.
    """
    vec = np.asarray(update)
    if vec.dtype.kind not in "fiu":
        raise ValueError(f"the update must be a real array, got dtype {vec.dtype}")
    n = _n_parameters(arrays)
    if vec.size != n or n == 0:
        _parse(config, pinned, arrays)  # a malformed config is named first
        raise ValueError(f"the update has {vec.size} entries; the model has {n} parameters")
    return payloads_from_updates(arrays, config, pinned, vec.reshape(1, -1), rng=rng)[0].tobytes()


def local_model(
    arrays: Sequence[np.ndarray], cfg: TrainConfig, x: np.ndarray, y: np.ndarray
) -> list[np.ndarray]:
    """The model after this client's local work, such that :mod:`shuffledp.clients.mod` derives the report of
    :func:`compute_update` from it.

    ``"delta"``: the model after ``cfg.local_epochs`` epochs of SGD (``w + delta``; the mod's ``w_local - w``,
    both in float64, is the delta of :func:`shuffledp.clients.models.local_delta`). ``"gradient"``: one
    full-batch step at ``cfg.local_lr`` (``w - lr * g``; the mod's ``(w - w_local) / lr`` is the average
    gradient up to the rounding of ``w_local`` to the model's dtype). Arrays keep the received dtypes and shapes.

    Args:
        arrays: the model as received (checked with :func:`check_model_fits_data`).
        cfg: the request's config.
        x: the local features.
        y: the local labels.

    Returns:
        The updated model's arrays, in parameter order.
    """
    w = [np.asarray(a) for a in arrays]
    vec = compute_update(w, cfg, x, y)
    step = vec if cfg.report == "delta" else -cfg.local_lr * vec
    out, start = [], 0
    with np.errstate(all="ignore"):  # an overflow gives inf, which the mod reports as the zero update
        for a in w:
            part = step[start:start + a.size].reshape(a.shape)
            start += a.size
            out.append((a.astype(np.float64) + part).astype(a.dtype))
    return out


def make_envelope(
    arrays: Sequence[np.ndarray],
    config: TrainConfig | Mapping[str, Any],
    pinned: PinnedSettings,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    rng: ChaCha20Rng | None = None,
    update: np.ndarray | None = None,
) -> bytes:
    """The sealed envelope for this request (see the module docstring): give exactly one of ``data`` (the
    report is computed here, :func:`make_payload`) and ``update`` (computed elsewhere,
    :func:`payload_from_update`)."""
    from shuffledp.shuffler.envelope import seal

    if (data is None) == (update is None):
        raise TypeError("make_envelope needs exactly one of data and update")
    cfg = _parse(config, pinned, arrays)
    arrays = [np.asarray(a) for a in arrays]
    digest = arrays_digest(arrays)
    if update is None:
        payload = make_payload(arrays, cfg, pinned, data, rng=rng)  # type: ignore[arg-type] - data is set here
    else:
        payload = payload_from_update(arrays, cfg, pinned, update, rng=rng)
    return seal(
        payload,
        server_public_key=bytes(pinned.server_public_key),
        shuffler_public_key=bytes(pinned.shuffler_public_key),
        signing_key=bytes(pinned.client_key),
        key_epoch=cfg.key_epoch,
        round_id=cfg.round,
        model_digest=digest,
    )
