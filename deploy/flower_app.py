"""The shuffledp Flower app directory that ``flwr run`` is pointed at, found or written.

From a checkout of the repository it is the repository root: its ``pyproject.toml`` holds ``[tool.flwr.app]``
(publisher, components, the run config's defaults). A non-editable install has no repository, so the same table
ships as package data (``flower_app.toml`` beside this module; a test keeps it equal to the repository's) and
:func:`find_app_dir` writes a minimal Flower project from it: a ``pyproject.toml`` and nothing else, whose
components import the installed ``shuffledp`` package.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import tomli_w

__all__ = ["AppNotFoundError", "APP_TABLE", "SERVERAPP", "app_table", "is_app_dir", "find_app_dir",
           "run_config_defaults"]

#: The ``[tool.flwr.app]`` table shipped with the package.
APP_TABLE = Path(__file__).with_name("flower_app.toml")
#: The ServerApp component every shuffledp app directory names.
SERVERAPP = "shuffledp.server.app:app"
#: Name of the directory :func:`find_app_dir` writes when no app directory is found.
WRITTEN_APP = "flower-app"


class AppNotFoundError(RuntimeError):
    """No shuffledp Flower app directory was found and none could be written; the message says why."""


def app_table() -> dict[str, Any]:
    """The ``[tool.flwr.app]`` table shipped with the package (publisher, components, config defaults).

    Raises:
        AppNotFoundError: the package data file is missing or not valid TOML (a broken install).
    """
    try:
        return dict(tomllib.loads(APP_TABLE.read_text())["tool"]["flwr"]["app"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise AppNotFoundError(f"the installed shuffledp has no readable {APP_TABLE.name} ({exc}); "
                               "reinstall it") from exc


def _app_of(directory: Path) -> dict[str, Any] | None:
    """The ``[tool.flwr.app]`` table of ``directory/pyproject.toml`` if it is shuffledp's app, else None."""
    pyproject = directory / "pyproject.toml"
    try:
        doc = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    app = doc.get("tool", {}).get("flwr", {}).get("app", {})
    if app.get("publisher") == "shuffledp" and app.get("components", {}).get("serverapp") == SERVERAPP:
        return app
    return None


def is_app_dir(directory: Path) -> bool:
    """Whether ``directory/pyproject.toml`` is a shuffledp Flower app (publisher shuffledp, its ServerApp)."""
    return _app_of(directory) is not None


def find_app_dir(start: Path | None = None, *, write_in: Path | None = None) -> Path:
    """The Flower app directory: ``start`` (default: the current directory) if it is the shuffledp app, else the
    checkout this package was installed from (an editable install), else one written into ``write_in``.

    Args:
        start: the directory tried first.
        write_in: where a minimal app directory (``write_in/flower-app/pyproject.toml``) is written when neither
            is an app directory: a non-editable install. None: do not write one.

    Returns:
        The app directory, resolved.

    Raises:
        AppNotFoundError: nothing was found and ``write_in`` is None.
    """
    for directory in (start or Path.cwd(), Path(__file__).resolve().parent.parent):
        if is_app_dir(directory):
            return directory.resolve()
    if write_in is None:
        raise AppNotFoundError(
            "cannot find the shuffledp Flower app (a pyproject.toml with [tool.flwr.app] publisher 'shuffledp' in "
            "the current directory or the checkout shuffledp was installed from)")
    app = write_in / WRITTEN_APP
    app.mkdir(parents=True, exist_ok=True)
    try:
        version = metadata.version("shuffledp")
    except metadata.PackageNotFoundError:
        version = "0.0.0"
    project = {"name": "shuffledp", "version": version, "license": "Apache-2.0",
               "description": "shuffledp's Flower app (components from the installed package)", "dependencies": []}
    (app / "pyproject.toml").write_text(tomli_w.dumps({"project": project, "tool": {"flwr": {"app": app_table()}}}))
    return app.resolve()


def run_config_defaults(app: Path) -> dict[str, Any]:
    """The run config's defaults, ``[tool.flwr.app.config]`` of the app directory ``app``.

    Raises:
        AppNotFoundError: ``app`` is not a shuffledp app directory.
    """
    table = _app_of(app)
    if table is None:
        raise AppNotFoundError(f"{app} is not a shuffledp Flower app directory (no pyproject.toml with its "
                               "[tool.flwr.app])")
    return dict(table.get("config", {}))
