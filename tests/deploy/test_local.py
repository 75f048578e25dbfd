"""shuffledp.deploy.local: deploy local's settings are checked before anything starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.local import LocalDeployment


@pytest.mark.parametrize("which", ["workdir", "keys_dir"])
def test_workdir_or_keys_inside_the_app_are_refused(which: str, tmp_path: Path,
                                                    shuffledp_app: Callable[..., Path]) -> None:
    """`flwr run` packs the app folder's TOML/JSON files into the app bundle; neither the run's directory nor the
    keys may be in it (the app folder itself included); a sibling of the app folder is fine."""
    app = shuffledp_app(tmp_path / "app")
    for inside in (app / "sub" / "dir", app):
        with pytest.raises(DeployError, match=f"--{'workdir' if which == 'workdir' else 'keys'} .* is inside "
                                                  "the app directory"):
            LocalDeployment(app_dir=app, **{which: inside}).validate()
    assert LocalDeployment(app_dir=app, **{which: tmp_path / "appx"}).validate() is None


def test_a_used_workdir_and_run_config_keys_the_deployment_sets_are_refused(tmp_path: Path) -> None:
    """A second run in the same --workdir would overwrite the first's results and read its old log lines; a
    --run-config of a key deploy local sets would contradict what the SuperNodes pin. Both are refused before
    anything starts, and the used directory is left as it was."""
    work = tmp_path / "work"
    work.mkdir()
    assert LocalDeployment(workdir=work).validate() is None  # an empty directory is fine
    (work / "deploy-result.json").write_text("{}")
    with pytest.raises(DeployError, match="not an empty directory"):
        LocalDeployment(workdir=work).validate()
    assert (work / "deploy-result.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    with pytest.raises(DeployError, match="not an empty directory"):
        LocalDeployment(workdir=tmp_path / "file").validate()
    for key, hint in (("eps0", "--eps0"), ("run-name", "wires it up"), ("key-epoch", "manifest"),
                      ("mechanism", "--mechanism"), ("target-epsilon", "account calibrate")):
        with pytest.raises(DeployError, match=f"--run-config {key} is set by deploy local itself.*{hint}"):
            LocalDeployment(run_config={key: 1}).validate()
    LocalDeployment(run_config={"local-epochs": 2}).validate()  # keys the deployment leaves alone pass
    # the SuperNodes' mechanism is checked as a device's bundle is
    LocalDeployment(mechanism="duchi", clip_l2=0.5).validate()
    with pytest.raises(DeployError, match="research-only"):
        LocalDeployment(mechanism="privunit2", clip_l2=0.5).validate()
    with pytest.raises(DeployError, match="needs --clip-l2"):
        LocalDeployment(mechanism="duchi").validate()




def test_a_bad_run_config_or_missing_data_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """What the ServerApp would refuse after the deployment started is refused by validate(), saying why."""
    with pytest.raises(DeployUsageError, match=r"unknown run config keys \['nosuch'\]; known keys: \[.*'eps0'"):
        LocalDeployment(run_config={"nosuch": 1}).validate()
    with pytest.raises(DeployUsageError, match="'local-epochs' must be an integer"):
        LocalDeployment(run_config={"local-epochs": "many"}).validate()
    with pytest.raises(DeployUsageError, match="is not a directory.*'dataset' and 'data-dir'"):
        LocalDeployment(run_config={"dataset": "mnist", "data-dir": str(tmp_path / "none")}).validate()
    LocalDeployment(run_config={"local-epochs": 1, "batch-size": 16}).validate()
