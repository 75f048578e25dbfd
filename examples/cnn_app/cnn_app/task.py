"""The app's own model and data: a small CNN and a loader for a folder of PNG images (one subfolder per class).

Nothing here is specific to shuffledp: it is what any Flower app has. Where no folder is given, a small set of
images is generated (bars, crosses and boxes with pixel noise) so that the app runs with no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

CLASSES = ("horizontal", "vertical", "cross", "box")


class Net(nn.Module):
    """Two 3x3 convolutions with max pooling and a linear head (about 500 parameters at 12x12)."""

    def __init__(self, image_size: int, n_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        side = image_size // 4
        self.fc = nn.Linear(8 * side * side, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of images shaped (batch, 1, size, size)."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def new_model(image_size: int, n_classes: int, seed: int) -> Net:
    """A freshly initialised model; ``seed`` fixes the initialisation (not privacy randomness)."""
    torch.manual_seed(seed)
    return Net(image_size, n_classes)


@dataclass(frozen=True)
class Images:
    """Images scaled to [0, 1], shaped (n, 1, size, size), and their integer labels."""

    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]


def _pattern(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    img = np.zeros((size, size), dtype=np.float32)
    a, b = sorted(rng.choice(np.arange(1, size - 1), size=2, replace=False))
    c = int(rng.integers(1, size - 1))
    if kind in ("horizontal", "cross"):
        img[c, a:b + 1] = 1.0
    if kind in ("vertical", "cross"):
        img[a:b + 1, c] = 1.0
    if kind == "box":
        img[a, a:b + 1] = img[b, a:b + 1] = img[a:b + 1, a] = img[a:b + 1, b] = 1.0
    return np.clip(img + rng.normal(0.0, 0.15, img.shape).astype(np.float32), 0.0, 1.0)


def generated_images(per_class: int, size: int, seed: int) -> Images:
    """``per_class`` generated images of each class in :data:`CLASSES` (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    x = np.stack([_pattern(k, size, rng) for k in CLASSES for _ in range(per_class)])[:, None]
    y = np.repeat(np.arange(len(CLASSES)), per_class)
    return Images(x=x, y=y, classes=CLASSES)


def write_image_folder(folder: Path, images: Images) -> None:
    """Write ``images`` as PNG files, ``folder/<class>/<i>.png`` (what :func:`load_image_folder` reads)."""
    from PIL import Image

    for i, (img, label) in enumerate(zip(images.x, images.y)):
        out = folder / images.classes[int(label)]
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.round(img[0] * 255).astype(np.uint8), mode="L").save(out / f"{i}.png")


def load_image_folder(folder: Path, size: int) -> Images:
    """Read ``folder/<class>/*.png`` (classes in sorted order), grayscale, resized to ``size`` x ``size``.

    Raises:
        ValueError: the folder has no class subfolder with PNG images.
    """
    from PIL import Image

    classes = tuple(sorted(d.name for d in Path(folder).iterdir() if d.is_dir() and any(d.glob("*.png"))))
    if not classes:
        raise ValueError(f"{folder} has no class subfolders with .png images (expected {folder}/<class>/*.png)")
    xs, ys = [], []
    for label, name in enumerate(classes):
        for path in sorted((Path(folder) / name).glob("*.png")):
            img = Image.open(path).convert("L").resize((size, size))
            xs.append(np.asarray(img, dtype=np.float32) / 255.0)
            ys.append(label)
    return Images(x=np.stack(xs)[:, None], y=np.asarray(ys), classes=classes)


def load_images(data_dir: str, size: int, per_class: int, seed: int) -> Images:
    """The app's dataset: the folder ``data_dir`` if given, else generated images."""
    if data_dir:
        return load_image_folder(Path(data_dir), size)
    return generated_images(per_class, size, seed)


def split(images: Images, seed: int, test_fraction: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the training split (partitioned among the clients) and of the server's test split."""
    order = np.random.default_rng(seed).permutation(len(images.y))
    n_test = max(1, int(round(test_fraction * len(order))))
    return order[n_test:], order[:n_test]


def partition(train: np.ndarray, partition_id: int, num_partitions: int, seed: int) -> np.ndarray:
    """The training indices of client ``partition_id`` of ``num_partitions`` (IID, deterministic in ``seed``)."""
    order = np.random.default_rng(seed + 1).permutation(train)
    return np.array_split(order, num_partitions)[partition_id]


def train_local(model: Net, x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float, batch_size: int) -> None:
    """Plain SGD on the client's images."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    model.train()
    for _ in range(epochs):
        for start in range(0, len(yt), batch_size):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[start:start + batch_size]), yt[start:start + batch_size]).backward()
            opt.step()


def evaluate(model: Net, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy and accuracy."""
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        labels = torch.from_numpy(y).long()
        loss = float(nn.functional.cross_entropy(logits, labels))
        accuracy = float((logits.argmax(1) == labels).float().mean())
    return loss, accuracy
