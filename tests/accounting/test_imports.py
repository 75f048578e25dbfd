"""The accounting package is pure math: importing any of its modules must not pull in torch, flwr or grpc.

Each check runs in a fresh interpreter (a subprocess), because the test process itself may already have
imported those packages for other tests.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

from shuffledp import accounting

FORBIDDEN = ("torch", "flwr", "grpc")

_PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r} or m == "dp_accounting")))
"""


def _loaded_after_importing(modules: list[str]) -> list[str]:
    root = Path(accounting.__file__).resolve().parent.parent  # any directory: the package is installed
    code = _PROBE.format(modules=modules, forbidden=FORBIDDEN)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _all_accounting_modules() -> list[str]:
    return sorted(
        f"shuffledp.accounting.{info.name}"
        for info in pkgutil.iter_modules(accounting.__path__)
        if not info.name.startswith("_")
    )


def test_there_are_modules_to_check() -> None:
    modules = _all_accounting_modules()
    for name in ("bounds", "families", "literature", "rdp", "mechanisms", "validation"):
        expected = f"shuffledp.accounting.{name}"
        assert expected in modules


def test_no_accounting_module_imports_torch_flwr_or_grpc() -> None:
    loaded = _loaded_after_importing(["shuffledp.accounting", *_all_accounting_modules()])
    offending = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert offending == [], f"accounting pulled in {offending}"


def test_package_import_is_light() -> None:
    # `import accounting` (Bound, RefusedError, FAMILIES) must not load the PLD engine.
    assert _loaded_after_importing(["shuffledp.accounting"]) == []
