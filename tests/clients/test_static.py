"""Randomness that touches privacy comes from a CSPRNG: no ``random`` or ``numpy.random`` in the client's report
path (noise, randomizer, report, sealing, the ClientApp) nor in the server's client sampling. ``clients/data.py``
is left out on purpose: its seeded ``numpy.random`` only splits a simulation's dataset into partitions; so is
``clients/models.py``, whose seeded ``torch.random`` only initialises the server's first model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shuffledp import clients, server

REPORT_PATH = ["app.py", "core.py", "messages.py", "mod.py", "noise.py", "randomizer.py", "report.py", "settings.py",
               "validation.py", "worktime.py", "mechanism.py", "coins.py", "sphere.py", "duchi.py", "privunit.py"]


_TORCH_SAMPLERS = {"manual_seed", "seed", "bernoulli", "normal", "multinomial", "poisson", "Generator"}


def _rng_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in ("random", "numpy.random")]
        elif isinstance(node, ast.ImportFrom) and node.module in ("random", "numpy.random", "numpy"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if node.module != "numpy" or a.name == "random"]
        elif isinstance(node, ast.Attribute) and node.attr == "random" and isinstance(node.value, ast.Name) \
                and node.value.id in ("np", "numpy", "torch"):
            found.append(f"{node.value.id}.random")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" \
                and (node.attr.startswith("rand") or node.attr in _TORCH_SAMPLERS):
            found.append(f"torch.{node.attr}")  # torch's global generator
    return found


@pytest.mark.parametrize("path", [Path(clients.__file__).parent / name for name in REPORT_PATH]
                         + [Path(server.__file__).parent / "rounds.py"], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_non_cryptographic_rng(path: Path) -> None:
    assert path.is_file()
    assert _rng_uses(path) == []


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import random\nfrom numpy import random as r\nimport numpy as np\nx = np.random.rand()\n"
                   "import torch\ny = torch.randn(3)\nz = torch.bernoulli(y)\n")
    assert sorted(_rng_uses(bad)) == sorted(["random", "numpy.random", "np.random", "torch.randn",
                                             "torch.bernoulli"])
    assert _rng_uses(Path(clients.__file__).parent / "data.py") == ["np.random", "np.random"]  # seeded splits


def test_sampling_draws_from_the_system_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    import secrets

    from shuffledp.server.rounds import sample_nodes

    calls = []

    class Spy(secrets.SystemRandom):
        def sample(self, population, k, **kw):  # type: ignore[override] - a spy that records k
            calls.append(k)
            return super().sample(population, k, **kw)

    monkeypatch.setattr(secrets, "SystemRandom", Spy)
    chosen = sample_nodes(list(range(100)), 0.3)
    assert calls == [30] and len(set(chosen)) == 30
