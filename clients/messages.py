"""The Flower message schema between the ServerApp and the ClientApp (docs/interfaces.md, binding).

Request: message type ``train.shuffled`` (:data:`MESSAGE_TYPE`), ``group_id = str(round)``;
``content["arrays"]`` is an ArrayRecord with the model (numpy arrays in parameter order);
``content["config"]`` is a ConfigRecord with the keys below (:class:`TrainConfig`).

Reply: ``content["envelope"]``, an ArrayRecord holding one uint8 array ``"ct"``: the sealed envelope, nothing
else. A refusal is an error reply ``Message(Error(code, reason), reply_to=msg)`` with one of the ``ERR_*`` codes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MESSAGE_TYPE",
    "ARRAYS_KEY",
    "CONFIG_KEY",
    "ENVELOPE_KEY",
    "ENVELOPE_ARRAY",
    "CFG_ROUND",
    "CFG_KEY_EPOCH",
    "CFG_EPS0",
    "CFG_CLIP_L1",
    "CFG_REPORT",
    "CFG_LOCAL_EPOCHS",
    "CFG_LOCAL_LR",
    "CFG_BATCH_SIZE",
    "CFG_MECHANISM",
    "CFG_CLIP_L2",
    "REPORT_KINDS",
    "ERR_PINNED_MISMATCH",
    "ERR_BAD_REQUEST",
    "ERR_CLIENT_SETUP",
    "RequestError",
    "TrainConfig",
    "arrays_digest",
    "array_chunks",
    "envelope_record",
    "envelope_from_record",
]

MESSAGE_TYPE = "train.shuffled"
ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
ENVELOPE_KEY = "envelope"
ENVELOPE_ARRAY = "ct"

CFG_ROUND = "round"
CFG_KEY_EPOCH = "key-epoch"
CFG_EPS0 = "eps0"
CFG_CLIP_L1 = "clip-l1"
CFG_REPORT = "report"
CFG_LOCAL_EPOCHS = "local-epochs"
CFG_LOCAL_LR = "local-lr"
CFG_BATCH_SIZE = "batch-size"
CFG_MECHANISM = "mechanism"  # optional: absent means "laplace"
CFG_CLIP_L2 = "clip-l2"  # optional: the L2 clip of the duchi / privunit2 mechanisms

REPORT_KINDS = ("gradient", "delta")

# Error codes of refusal replies (Message(Error(code, reason), reply_to=msg)).
ERR_PINNED_MISMATCH = 4001  # the request's mechanism / eps0 / clip differ from the client's pinned values
ERR_BAD_REQUEST = 4002  # malformed request: missing/ill-typed config, wrong arrays, bad round
ERR_CLIENT_SETUP = 5001  # the client itself is misconfigured (missing key file, pinned values absent)

_MAX_ROUND = 2**63 - 1
_MAX_EPOCH = 2**32 - 1


class RequestError(ValueError):
    """The server's request is malformed (missing key, wrong type, value out of range)."""


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg:
        raise RequestError(f"config is missing required key {key!r}")
    return cfg[key]


def _int(cfg: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise RequestError(f"config[{key!r}] must be an int, got {type(v).__name__} {v!r}")
    if not lo <= int(v) <= hi:
        raise RequestError(f"config[{key!r}] must be in [{lo}, {hi}], got {v}")
    return int(v)


def _pos_float(cfg: Mapping[str, Any], key: str) -> float:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise RequestError(f"config[{key!r}] must be a number, got {type(v).__name__} {v!r}")
    f = float(v)
    if not (math.isfinite(f) and f > 0.0):
        raise RequestError(f"config[{key!r}] must be finite and > 0, got {v!r}")
    return f


@dataclass(frozen=True)
class TrainConfig:
    """Typed ``content["config"]`` of a ``train.shuffled`` request."""

    round: int
    key_epoch: int
    eps0: float
    clip_l1: float
    report: str = "gradient"
    local_epochs: int = 1
    local_lr: float = 0.1
    batch_size: int = 32
    #: the local randomizer the server asks for (shuffledp.clients.mechanism.MECHANISMS); the client refuses any
    #: other than its pinned one
    mechanism: str = "laplace"
    #: the L2 clip of the duchi / privunit2 mechanisms (None: not sent)
    clip_l2: float | None = None

    def __post_init__(self) -> None:
        # Validate through the parser (one source of truth for the rules) and store normalised types.
        parsed = TrainConfig.from_mapping(self._raw())
        for name in _FIELDS:
            object.__setattr__(self, name, getattr(parsed, name))

    def _raw(self) -> dict[str, Any]:
        raw = {
            CFG_ROUND: self.round, CFG_KEY_EPOCH: self.key_epoch, CFG_EPS0: self.eps0,
            CFG_CLIP_L1: self.clip_l1, CFG_REPORT: self.report, CFG_LOCAL_EPOCHS: self.local_epochs,
            CFG_LOCAL_LR: self.local_lr, CFG_BATCH_SIZE: self.batch_size, CFG_MECHANISM: self.mechanism,
        }
        if self.clip_l2 is not None:
            raw[CFG_CLIP_L2] = self.clip_l2
        return raw

    def to_dict(self) -> dict[str, Any]:
        """The ConfigRecord contents (keys as in docs/interfaces.md; ``clip-l2`` only when set)."""
        out: dict[str, Any] = {
            CFG_ROUND: int(self.round),
            CFG_KEY_EPOCH: int(self.key_epoch),
            CFG_EPS0: float(self.eps0),
            CFG_CLIP_L1: float(self.clip_l1),
            CFG_REPORT: str(self.report),
            CFG_LOCAL_EPOCHS: int(self.local_epochs),
            CFG_LOCAL_LR: float(self.local_lr),
            CFG_BATCH_SIZE: int(self.batch_size),
            CFG_MECHANISM: str(self.mechanism),
        }
        if self.clip_l2 is not None:
            out[CFG_CLIP_L2] = float(self.clip_l2)
        return out

    def to_config_record(self) -> Any:
        """A ``flwr.app.ConfigRecord`` for ``content["config"]``."""
        from flwr.app import ConfigRecord

        return ConfigRecord(self.to_dict())

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> TrainConfig:
        """Parse and validate a request config (a ConfigRecord or any mapping).

        Raises :class:`RequestError` naming the offending key and the allowed values.
        """
        if not isinstance(cfg, Mapping):
            raise RequestError(f"config must be a mapping, got {type(cfg).__name__}")
        rnd = _int(cfg, CFG_ROUND, 0, _MAX_ROUND)
        epoch = _int(cfg, CFG_KEY_EPOCH, 0, _MAX_EPOCH)
        eps0 = _pos_float(cfg, CFG_EPS0)
        clip = _pos_float(cfg, CFG_CLIP_L1)
        report = _get(cfg, CFG_REPORT)
        if report not in REPORT_KINDS:
            raise RequestError(f"config[{CFG_REPORT!r}] must be one of {REPORT_KINDS}, got {report!r}")
        local_epochs = _int(cfg, CFG_LOCAL_EPOCHS, 1, 10_000)
        local_lr = _pos_float(cfg, CFG_LOCAL_LR)
        batch_size = _int(cfg, CFG_BATCH_SIZE, 1, 2**31 - 1)
        mechanism = cfg.get(CFG_MECHANISM, "laplace")
        if mechanism not in _MECHANISM_NAMES:
            raise RequestError(f"config[{CFG_MECHANISM!r}] must be one of {_MECHANISM_NAMES}, got {mechanism!r}")
        clip_l2 = _pos_float(cfg, CFG_CLIP_L2) if CFG_CLIP_L2 in cfg else None
        obj = object.__new__(cls)
        for name, val in (
            ("round", rnd),
            ("key_epoch", epoch),
            ("eps0", eps0),
            ("clip_l1", clip),
            ("report", report),
            ("local_epochs", local_epochs),
            ("local_lr", local_lr),
            ("batch_size", batch_size),
            ("mechanism", str(mechanism)),
            ("clip_l2", clip_l2),
        ):
            object.__setattr__(obj, name, val)
        return obj


_FIELDS = ("round", "key_epoch", "eps0", "clip_l1", "report", "local_epochs", "local_lr", "batch_size", "mechanism",
           "clip_l2")
#: shuffledp.clients.mechanism.MECHANISMS (kept here too: this schema module imports no randomizer)
_MECHANISM_NAMES = ("laplace", "duchi", "privunit2")


def array_chunks(arrays: Sequence[np.ndarray]) -> Iterator[bytes]:
    """Canonical byte chunks of a model: for each array, its dtype, its shape, then its C-order bytes.

    Arrays are normalised to little-endian so that the same values give the same chunks on any machine.
    """
    for i, a in enumerate(arrays):
        arr = np.asarray(a)
        if arr.dtype.hasobject:
            raise TypeError(f"array {i} has object dtype; only numeric arrays can be digested")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        yield arr.dtype.str.encode("ascii")
        yield struct.pack(f"<Q{arr.ndim}Q", arr.ndim, *arr.shape)
        yield arr.tobytes()


def arrays_digest(arrays: Sequence[np.ndarray] | Any) -> bytes:
    """Digest that binds a report to the model it was computed at.

    ``shuffledp.shuffler.envelope.model_digest`` (SHA-256 over length-prefixed chunks) over :func:`array_chunks`.
    Accepts a list of numpy arrays or a ``flwr.app.ArrayRecord`` (digested in its stored order). The client
    computes it on what it received, the server on what it sent.
    """
    from shuffledp.shuffler.envelope import model_digest

    if hasattr(arrays, "to_numpy_ndarrays"):
        arrays = arrays.to_numpy_ndarrays()
    return model_digest(array_chunks(list(arrays)))


def envelope_record(envelope: bytes) -> Any:
    """The reply's ``content["envelope"]``: an ArrayRecord with one uint8 array ``"ct"``."""
    from flwr.app import Array, ArrayRecord

    if not isinstance(envelope, (bytes, bytearray)) or len(envelope) == 0:
        raise ValueError("envelope must be non-empty bytes")
    ct = np.frombuffer(bytes(envelope), dtype=np.uint8).copy()
    return ArrayRecord({ENVELOPE_ARRAY: Array.from_numpy_ndarray(ct)})


def envelope_from_record(record: Any) -> bytes:
    """Extract the envelope bytes from a reply's ArrayRecord; ValueError if the shape is not the schema's."""
    keys = list(record.keys())
    if keys != [ENVELOPE_ARRAY]:
        raise ValueError(f"envelope record must hold exactly one array {ENVELOPE_ARRAY!r}, got {keys}")
    arr = record[ENVELOPE_ARRAY].numpy()
    if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"envelope array must be non-empty 1-D uint8, got {arr.dtype} shape {arr.shape}")
    return arr.tobytes()
