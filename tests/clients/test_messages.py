"""Message schema: typed config parsing, the model digest, the envelope record."""

from __future__ import annotations

import numpy as np
import pytest

from shuffledp.clients.messages import (
    ENVELOPE_ARRAY,
    RequestError,
    TrainConfig,
    arrays_digest,
    envelope_from_record,
    envelope_record,
)

GOOD = {
    "round": 3,
    "key-epoch": 0,
    "eps0": 2.0,
    "clip-l1": 1.0,
    "report": "gradient",
    "local-epochs": 1,
    "local-lr": 0.05,
    "batch-size": 32,
}


def test_parse_good_config_and_round_trip() -> None:
    cfg = TrainConfig.from_mapping(GOOD)
    assert (cfg.round, cfg.key_epoch, cfg.eps0, cfg.clip_l1, cfg.report) == (3, 0, 2.0, 1.0, "gradient")
    assert TrainConfig.from_mapping(cfg.to_dict()) == cfg
    rec = cfg.to_config_record()
    assert TrainConfig.from_mapping(dict(rec)) == cfg
    # ints are accepted for float fields and normalised
    assert TrainConfig(round=1, key_epoch=0, eps0=2, clip_l1=1).eps0 == 2.0


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("round", None, "missing required key 'round'"),
        ("round", 1.5, "must be an int"),
        ("round", True, "must be an int"),
        ("round", -1, "must be in"),
        ("eps0", "2", "must be a number"),
        ("eps0", 0.0, "finite and > 0"),
        ("eps0", float("nan"), "finite and > 0"),
        ("clip-l1", -1.0, "finite and > 0"),
        ("report", "weights", "must be one of"),
        ("local-epochs", 0, "must be in"),
        ("batch-size", 0, "must be in"),
        ("key-epoch", 2**32, "must be in"),
    ],
)
def test_parse_rejects(key: str, value, match: str) -> None:
    cfg = dict(GOOD)
    if value is None:
        del cfg[key]
    else:
        cfg[key] = value
    with pytest.raises(RequestError, match=match):
        TrainConfig.from_mapping(cfg)


def test_arrays_digest_binds_dtype_shape_and_bytes() -> None:
    a = [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(3, dtype=np.float32)]
    d = arrays_digest(a)
    assert len(d) == 32 and arrays_digest([x.copy() for x in a]) == d
    variants = [
        [a[0].astype(np.float64), a[1]],  # dtype
        [a[0].reshape(3, 2), a[1]],  # shape
        [a[0].reshape(6), a[1]],  # ndim
        [a[0] + np.float32(1e-7), a[1]],  # bytes
        [a[1], a[0]],  # order
        [np.concatenate([a[0].reshape(-1), a[1]])],  # split points
    ]
    for v in variants:
        assert arrays_digest(v) != d
    # byte order is normalised: the same values big-endian give the same digest
    assert arrays_digest([a[0].astype(">f4"), a[1]]) == d
    # an ArrayRecord digests like its arrays
    from flwr.app import ArrayRecord

    assert arrays_digest(ArrayRecord(a)) == d


def test_envelope_record_round_trip_and_schema() -> None:
    from flwr.app import Array, ArrayRecord

    rec = envelope_record(b"\x00\x01sealed")
    assert list(rec.keys()) == [ENVELOPE_ARRAY]
    assert envelope_from_record(rec) == b"\x00\x01sealed"
    with pytest.raises(ValueError):
        envelope_record(b"")
    extra = ArrayRecord({"ct": Array.from_numpy_ndarray(np.zeros(3, np.uint8)),
                         "x": Array.from_numpy_ndarray(np.zeros(3, np.uint8))})
    with pytest.raises(ValueError, match="exactly one array"):
        envelope_from_record(extra)
    wrong = ArrayRecord({"ct": Array.from_numpy_ndarray(np.zeros(3, np.float32))})
    with pytest.raises(ValueError, match="uint8"):
        envelope_from_record(wrong)
