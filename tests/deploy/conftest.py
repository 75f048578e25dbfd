"""Fixtures shared by the tests of shuffledp.deploy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shuffledp.deploy.flower_app import SERVERAPP


@pytest.fixture
def shuffledp_app() -> Callable[..., Path]:
    """A factory of minimal shuffledp Flower app directories (what shuffledp.deploy.flower_app.is_app_dir accepts):
    ``shuffledp_app(path, config)`` writes ``path/pyproject.toml`` with ``config`` as its run-config defaults."""

    def make(app: Path, config: str = "") -> Path:
        app.mkdir()
        (app / "pyproject.toml").write_text(f"[project]\nname = 'x'\n[tool.flwr.app]\npublisher = 'shuffledp'\n"
                                            f"[tool.flwr.app.components]\nserverapp = '{SERVERAPP}'\n"
                                            f"[tool.flwr.app.config]\n{config}")
        return app

    return make
