"""The Flower message schema between the ServerApp and the ClientApp (docs/interfaces.md, binding).

Request: message type ``train.shuffled`` (:data:`MESSAGE_TYPE`), ``group_id = str(round)``;
``content["arrays"]`` is an ArrayRecord with the model (numpy arrays in parameter order);
``content["config"]`` is a ConfigRecord with the keys below (:class:`TrainConfig`).

Reply: ``content["envelope"]``, an ArrayRecord holding one uint8 array ``"ct"``: the sealed envelope, nothing
else. A refusal is an error reply ``Message(Error(code, reason), reply_to=msg)`` with one of the ``ERR_*`` codes.

Flower's ``Array`` holds an ``.npy`` file in bytes. :func:`array_to_numpy` and :func:`array_from_numpy` read and
write it as ``Array.numpy()`` and ``Array.from_numpy_ndarray`` do, with numpy's own header parser and writer run
once per distinct header instead of once per array; :func:`read_model` reads a request's model once per distinct
content (every client of a round receives the same model).
"""

from __future__ import annotations

import io
import math
import struct
import threading
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
    "array_to_numpy",
    "array_from_numpy",
    "array_record",
    "ReceivedModel",
    "read_model",
    "record_of",
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
        arrays = [array_to_numpy(a) for a in arrays.values()]
    arrays = list(arrays)
    known = _received_digest(arrays)
    return known if known is not None else model_digest(array_chunks(arrays))


def record_of(content: Any, key: str, kind: type) -> Any:
    """``content[key]`` if it is a record of type ``kind`` (``flwr.app.ArrayRecord``, ``ConfigRecord``, ...), else
    None: what ``content.array_records.get(key)`` answers for ArrayRecord, without building Flower's filtered copy
    of the whole RecordDict on every access.

    Returns:
        The record, or None.
    """
    record = content.get(key)
    return record if isinstance(record, kind) else None


def envelope_record(envelope: bytes) -> Any:
    """The reply's ``content["envelope"]``: an ArrayRecord with one uint8 array ``"ct"``."""
    if not isinstance(envelope, (bytes, bytearray)) or len(envelope) == 0:
        raise ValueError("envelope must be non-empty bytes")
    return array_record({ENVELOPE_ARRAY: np.frombuffer(bytes(envelope), dtype=np.uint8)})


def envelope_from_record(record: Any) -> bytes:
    """Extract the envelope bytes from a reply's ArrayRecord; ValueError if the shape is not the schema's."""
    keys = list(record.keys())
    if keys != [ENVELOPE_ARRAY]:
        raise ValueError(f"envelope record must hold exactly one array {ENVELOPE_ARRAY!r}, got {keys}")
    arr = array_to_numpy(record[ENVELOPE_ARRAY])
    if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"envelope array must be non-empty 1-D uint8, got {arr.dtype} shape {arr.shape}")
    return arr.tobytes()


# -- Flower Arrays as numpy ----------------------------------------------------------------------------------------

_NPY_V1 = b"\x93NUMPY\x01\x00"  # the magic and version 1.0 of the .npy format (what np.save writes)
#: .npy header (magic to newline) -> (dtype, shape, data bytes) of a C-order array without objects, or None for
#: any other header (np.load decides those). At most _HEADERS_MAX entries.
_read_headers: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], int] | None] = {}
#: (dtype.str, shape) -> the header np.save writes for a C-contiguous array of that dtype and shape, and the
#: Array's dtype and stype fields
_write_headers: dict[tuple[str, tuple[int, ...]], tuple[bytes, str, str]] = {}
_HEADERS_MAX = 64
_lock = threading.Lock()


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    with _lock:
        if len(cache) >= _HEADERS_MAX:
            cache.clear()
        cache[key] = value


def _npy_layout(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int] | None:
    """The array a version-1.0 ``.npy`` header describes, parsed by numpy's own reader (as ``np.load``), once per
    distinct header; None unless it is a C-order array without objects and with at least one byte of data."""
    known = _read_headers.get(header, _read_headers)  # the dict itself: not seen
    if known is not _read_headers:
        return known  # type: ignore[return-value] - a layout or None, stored below
    try:
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(io.BytesIO(header[len(_NPY_V1):]))
    except (ValueError, TypeError, SyntaxError):
        layout = None  # np.load names the problem
    else:
        nbytes = math.prod(shape) * dtype.itemsize
        layout = None if fortran_order or dtype.hasobject or nbytes == 0 else (dtype, tuple(shape), nbytes)
    _remember(_read_headers, header, layout)
    return layout


def array_to_numpy(array: Any) -> np.ndarray:
    """A Flower ``Array`` as numpy: what ``array.numpy()`` returns (``np.load(allow_pickle=False)`` of its ``.npy``
    bytes: same dtype, shape and values, same errors), read-only, without copying its data. The header is parsed by
    numpy's reader once per distinct header; other layouts (Fortran order, format 2.0 / 3.0, an empty array,
    trailing or missing bytes, another serialization) go through ``array.numpy()`` itself.

    Returns:
        The array, not writeable (a view of the Array's bytes).
    """
    from flwr.common.constant import SType

    data = array.data
    if array.stype == SType.NUMPY and isinstance(data, bytes) and data[:len(_NPY_V1)] == _NPY_V1 and len(data) > 10:
        end = 10 + int.from_bytes(data[8:10], "little")
        layout = _npy_layout(data[:end])
        if layout is not None and len(data) - end == layout[2]:
            return np.frombuffer(data, dtype=layout[0], offset=end).reshape(layout[1])
    return array.numpy()  # type: ignore[no-any-return] - Flower's Array.numpy returns an ndarray


def array_from_numpy(a: np.ndarray) -> Any:
    """``flwr.app.Array.from_numpy_ndarray(a)``: the same fields and ``.npy`` bytes, with the header written by
    numpy once per (dtype, shape) for a C-contiguous array of numbers.

    Returns:
        A ``flwr.app.Array``.
    """
    from flwr.app import Array

    if not (type(a) is np.ndarray and a.flags.c_contiguous and a.dtype.kind in "biufc" and a.dtype.names is None
            and a.dtype.metadata is None and a.nbytes > 0):
        return Array.from_numpy_ndarray(a)
    key = (a.dtype.str, a.shape)
    known = _write_headers.get(key)
    if known is None:
        full = Array.from_numpy_ndarray(a)
        known = (full.data[:len(full.data) - a.nbytes], full.dtype, full.stype)
        _remember(_write_headers, key, known)
    return Array(dtype=known[1], shape=a.shape, stype=known[2], data=known[0] + a.tobytes())


def array_record(arrays: Mapping[str, np.ndarray]) -> Any:
    """``flwr.app.ArrayRecord({name: Array.from_numpy_ndarray(a)})``, each Array built once (:func:`array_from_numpy`;
    the dict constructor of ArrayRecord builds every Array a second time, as a copy).

    Returns:
        A ``flwr.app.ArrayRecord``, in the mapping's order.
    """
    from flwr.app import ArrayRecord

    record = ArrayRecord()
    for name, a in arrays.items():
        record[name] = array_from_numpy(a)
    return record


@dataclass(frozen=True)
class ReceivedModel:
    """A request's model (its ``content["arrays"]``), read once per distinct content."""

    #: the array names, in the record's order
    names: tuple[str, ...]
    #: the arrays, in the same order, read-only (:func:`array_to_numpy`)
    arrays: tuple[np.ndarray, ...]
    #: :func:`arrays_digest` of the arrays
    digest: bytes


#: The latest models read (most recent first), each with the record content it was read from. Every client of a
#: round receives the same model, and an actor of a simulation serves thousands of clients per round. Entries hold
#: their read-only arrays, so the identity of an array in one of them is that entry's for as long as it is kept.
_models: list[tuple[tuple[Any, ...], ReceivedModel]] = []
_MODELS_MAX = 4


def _record_key(record: Any) -> tuple[Any, ...]:
    return tuple((name, a.stype, a.dtype, tuple(a.shape), a.data) for name, a in record.items())


def read_model(record: Any) -> ReceivedModel:
    """A request's model from its ArrayRecord: names, arrays (as ``record.to_numpy_ndarrays()``, read-only) and
    digest, read once for every record of the same content (names, serialization, dtypes, shapes and bytes).

    Returns:
        The model; the same object for records of equal content while it is among the latest 4 read.

    Raises:
        ValueError, TypeError: an array that ``Array.numpy()`` cannot read (the same errors).
    """
    key = _record_key(record)
    for seen, model in list(_models):
        if seen == key:
            return model
    arrays = tuple(array_to_numpy(a) for a in record.values())
    model = ReceivedModel(tuple(record.keys()), arrays, arrays_digest(arrays))
    with _lock:
        _models.insert(0, (key, model))
        del _models[_MODELS_MAX:]
    return model


def _received_digest(arrays: Sequence[Any]) -> bytes | None:
    """The digest of a model :func:`read_model` returned, if ``arrays`` are its very arrays (read-only: their
    content is the content digested), else None."""
    for _, model in list(_models):
        got = model.arrays
        if len(got) == len(arrays) and got and all(a is b for a, b in zip(got, arrays)):
            return model.digest
    return None
