"""The repository is ruff clean with the configuration in pyproject.toml (line length, pyflakes, import order,
docstrings of the public API), and every suppression says why."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("accounting", "shuffler", "clients", "server", "deploy", "tests", "benchmarks")


def test_ruff_is_clean() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *SOURCES], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_every_suppression_says_why() -> None:
    bare = []
    for path in sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue  # generated
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in re.finditer(r"#\s*(noqa(?::\s*[A-Z0-9, ]+)?|type:\s*ignore(?:\[[\w\-, ]+\])?)(.*)", line):
                reason = match.group(2).strip(" -:")
                if len(reason) < 3:
                    bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert bare == []
