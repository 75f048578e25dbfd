"""Helper for the tests of the shuffler's O_DIRECT reads: a filesystem that refuses them."""

from __future__ import annotations

import errno
import os

import pytest


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``os.open`` refuse ``O_DIRECT`` with EINVAL, as tmpfs and some network filesystems do; other opens
    go through."""
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
