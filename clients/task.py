"""The names docs/interfaces.md lists under ``clients.task`` (data and models), re-exported from their homes.

Data and partitions live in :mod:`clients.data`, models and local computations in :mod:`clients.models`; the
client core (request -> envelope) in :mod:`clients.core`.
"""

from __future__ import annotations

from clients.data import Dataset, load_data, load_mnist, load_partition, partition, read_idx
from clients.models import (
    average_gradient,
    build_model,
    evaluate,
    get_arrays,
    initial_arrays,
    local_delta,
    model_from_arrays,
    set_arrays,
)

__all__ = [
    "Dataset",
    "load_data",
    "load_mnist",
    "load_partition",
    "partition",
    "read_idx",
    "average_gradient",
    "build_model",
    "evaluate",
    "get_arrays",
    "initial_arrays",
    "local_delta",
    "model_from_arrays",
    "set_arrays",
]
