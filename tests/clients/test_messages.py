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


def _arrays_of_every_layout() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((10, 20)).astype(np.float32),
        rng.standard_normal(10).astype(np.float32),
        rng.standard_normal((3, 4)),  # float64
        rng.standard_normal((2, 3)).astype(">f4"),  # big-endian
        np.asfortranarray(rng.standard_normal((3, 5)).astype(np.float32)),  # Fortran order: numpy's own path
        rng.standard_normal((4, 6)).astype(np.float32)[:, ::2],  # not contiguous
        np.array(1.5, np.float32),  # 0-d
        np.zeros((0, 3), np.float32),  # empty
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.array([True, False]),
        np.array([1 + 2j, 3 - 1j], np.complex64),
        np.frombuffer(b"\x01\x02\x03", dtype=np.uint8),
        np.zeros(3, dtype=[("a", "<f4"), ("b", "<i2")]),  # structured
    ]


def test_arrays_read_and_written_as_flower_does() -> None:
    from flwr.app import Array

    from shuffledp.clients.messages import array_from_numpy, array_to_numpy

    for a in _arrays_of_every_layout():
        # C-order .npy with data: read as a view of the bytes; numpy's own reader otherwise
        view = a.size > 0 and not (a.flags.f_contiguous and not a.flags.c_contiguous)
        ours, flowers = array_from_numpy(a), Array.from_numpy_ndarray(a)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (flowers.dtype, flowers.shape, flowers.stype,
                                                                    flowers.data)
        for arr in (ours, flowers, array_from_numpy(a)):  # the second write and read use the remembered header
            got, want = array_to_numpy(arr), arr.numpy()
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
            assert got.flags.writeable is not view


def test_array_to_numpy_refuses_what_flower_refuses() -> None:
    from flwr.app import Array

    from shuffledp.clients.messages import array_to_numpy

    good = Array.from_numpy_ndarray(np.arange(6, dtype=np.float32)).data
    header = good[:len(good) - 24]
    cases = [
        good[:-1],  # truncated
        good + b"\x00" * 4,  # trailing bytes: numpy ignores them
        header.replace(b"'<f4'", b"'|O' "),  # object dtype: allow_pickle=False refuses
        header.replace(b"(6,)", b"(7,)") + good[len(header):],  # more elements than bytes
        b"\x93NUMPY\x01\x00\x10\x00{'descr': 1}   \n" + good[len(header):],  # malformed header
        b"not an npy file at all",
    ]
    for data in cases:
        arr = Array(dtype="float32", shape=(6,), stype="numpy.ndarray", data=data)
        try:
            want: object = arr.numpy()
        except Exception as exc:  # noqa: BLE001 - the test compares whatever numpy raises
            with pytest.raises(type(exc)):
                array_to_numpy(arr)
            continue
        got = array_to_numpy(arr)
        assert isinstance(want, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    with pytest.raises(TypeError):
        array_to_numpy(Array(dtype="float32", shape=(6,), stype="torch", data=good))


def test_read_model_once_per_content_and_read_only() -> None:
    from flwr.app import Array, ArrayRecord

    from shuffledp.clients.messages import read_model

    rng = np.random.default_rng(1)
    w = [rng.standard_normal((10, 20)).astype(np.float32), rng.standard_normal(10).astype(np.float32)]

    def record(arrays: list[np.ndarray], names: tuple[str, ...] = ("0", "1")) -> ArrayRecord:
        return ArrayRecord({n: Array.from_numpy_ndarray(a) for n, a in zip(names, arrays)})

    first = read_model(record(w))
    assert read_model(record(w)) is first  # another record, equal content: read once
    assert first.names == ("0", "1")
    assert first.digest == arrays_digest(w) == arrays_digest(list(first.arrays)) == arrays_digest(record(w))
    for got, want in zip(first.arrays, w):
        assert got.dtype == want.dtype and np.array_equal(got, want)
        with pytest.raises(ValueError):
            got.setflags(write=True)  # a view of immutable bytes: its content is what was digested
        with pytest.raises(ValueError):
            got[...] = 0
    moved = [w[0] + np.float32(1e-3), w[1]]
    assert read_model(record(moved)) is not first and read_model(record(moved)).digest == arrays_digest(moved)
    renamed = read_model(record(w, ("a", "b")))
    assert renamed is not first and renamed.names == ("a", "b") and renamed.digest == first.digest
    # arrays equal to a read model's, but not its own objects, are digested from their content
    assert arrays_digest([a.copy() for a in first.arrays]) == first.digest
    assert arrays_digest([first.arrays[0], first.arrays[1].copy() + 1]) != first.digest
