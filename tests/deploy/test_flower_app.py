"""The Flower app directory: the checkout's, or one written for a non-editable install; and such an install for
real (a fresh virtual environment, ``pip install .``, one round of ``shuffledp run`` from another directory)."""

from __future__ import annotations

import os
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest

from shuffledp.deploy import flower_app

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_app_table_equals_the_repositorys() -> None:
    repo = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert flower_app.app_table() == repo
    assert repo["components"]["serverapp"] == flower_app.SERVERAPP


def test_the_checkout_is_found_from_anywhere(tmp_path: Path) -> None:
    assert flower_app.find_app_dir() == ROOT.resolve() or Path.cwd().resolve() == flower_app.find_app_dir()
    assert flower_app.find_app_dir(tmp_path) == ROOT.resolve()  # the editable install's checkout
    assert not flower_app.is_app_dir(tmp_path)


def test_without_a_checkout_an_app_is_written_or_the_error_says_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(flower_app, "__file__", str(tmp_path / "site" / "shuffledp" / "deploy" / "flower_app.py"))
    with pytest.raises(flower_app.AppNotFoundError, match="cannot find the shuffledp Flower app"):
        flower_app.find_app_dir(tmp_path)
    app = flower_app.find_app_dir(tmp_path, write_in=tmp_path / "run")
    assert app == (tmp_path / "run" / "flower-app").resolve() and flower_app.is_app_dir(app)
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]  # the components come from the installed package
    assert flower_app.run_config_defaults(app) == flower_app.app_table()["config"]
    with pytest.raises(flower_app.AppNotFoundError, match="is not a shuffledp Flower app"):
        flower_app.run_config_defaults(tmp_path)


@pytest.mark.e2e
def test_a_non_editable_install_runs_one_round_from_another_directory(tmp_path: Path) -> None:
    """``pip install .`` (no ``-e``) into a fresh virtual environment, then ``shuffledp run --rounds 1`` from a
    directory that is not the checkout. The environment sees the machine's packages (torch, flwr, ... are not
    downloaded again) but installs shuffledp itself, without dependencies, from a copy of the repository."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    source = tmp_path / "src"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(source)], check=True, timeout=120)
    subprocess.run(["git", "-C", str(ROOT), "diff", "HEAD", "--binary", "--output", str(tmp_path / "wip.patch")],
                   check=True, timeout=60)
    if (tmp_path / "wip.patch").stat().st_size:  # the uncommitted change under test, too
        subprocess.run(["git", "-C", str(source), "apply", str(tmp_path / "wip.patch")], check=True, timeout=60)
    for untracked in subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--exclude-standard"],
                                    capture_output=True, text=True, check=True).stdout.split():
        (source / untracked).parent.mkdir(parents=True, exist_ok=True)
        (source / untracked).write_bytes((ROOT / untracked).read_bytes())
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import shuffledp.server.app as m; print(m.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout  # the installed copy, not the checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    run = subprocess.run([str(env_dir / "bin" / "shuffledp"), "run", "--clients", "20", "--rounds", "1"],
                         cwd=elsewhere, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "[shuffledp] round 1/1: 20 reports (attested)" in run.stdout, run.stdout[-3000:]
    [out] = list((elsewhere / "outputs").iterdir())
    assert (out / "report.json").is_file() and (out / "flower-app" / "pyproject.toml").is_file()
