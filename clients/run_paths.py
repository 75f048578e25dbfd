"""Where a run's folder and, in a simulation, its key directory are: one rule for the ServerApp and the ClientApps.

A run's outputs go to ``<output-dir>/<run-name>/``, or ``<output-dir>/run-<run id>/`` when ``run-name`` is empty.
In a simulation whose run config leaves ``keys-dir`` empty, the ServerApp creates the run's keys in that folder's
``keys/`` once it knows how many nodes there are, and every simulated ClientApp finds its key there: both sides
derive the path from the same run config and run id with :func:`simulation_keys_dir`. Relative paths resolve
against the working directory of the process, which in a Flower simulation is the same for the ServerApp and the
ClientApps (the simulation process and its workers share it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["run_folder", "simulation_keys_dir", "planned_eps0", "KEYS_SUBDIR", "PLAN_FILE"]

#: The key directory's name inside the run folder when the run config does not name one.
KEYS_SUBDIR = "keys"
#: The plan of a run planned from a target epsilon, in its run folder (written by the ServerApp before round 1).
PLAN_FILE = "plan.json"


def _resolved(value: str, base: Path | None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base or Path.cwd()) / path


def run_folder(output_dir: str, run_name: str, run_id: int, *, base: Path | None = None) -> Path:
    """Return the run's folder: ``<output-dir>/<run-name>``, or ``<output-dir>/run-<run_id>`` if the name is empty.

    Args:
        output_dir: the run config's ``output-dir`` (relative paths resolve against ``base``).
        run_name: the run config's ``run-name`` ("" for none).
        run_id: Flower's run id.
        base: what relative paths resolve against (default: the working directory).
    """
    return _resolved(output_dir, base) / (run_name or f"run-{int(run_id)}")


def simulation_keys_dir(run_config: Mapping[str, Any], run_id: int, *, base: Path | None = None) -> tuple[Path, bool]:
    """Return ``(key directory, derived)`` for a simulation: ``keys-dir`` when the run config sets it (derived
    False), else ``<run folder>/keys`` (derived True; the ServerApp creates it before the first round).

    Args:
        run_config: Flower's run config (``keys-dir``, ``output-dir``, ``run-name``; missing keys count as empty,
            ``output-dir`` as ``outputs``).
        run_id: Flower's run id (``context.run_id``, the same on the ServerApp and every ClientApp of a run).
        base: what relative paths resolve against (default: the working directory).
    """
    keys_dir = str(run_config.get("keys-dir", "") or "").strip()
    if keys_dir:
        return _resolved(keys_dir, base), False
    folder = run_folder(str(run_config.get("output-dir", "outputs") or "outputs"),
                        str(run_config.get("run-name", "") or ""), run_id, base=base)
    return folder / KEYS_SUBDIR, True


def planned_eps0(run_config: Mapping[str, Any], run_id: int, *, base: Path | None = None) -> float:
    """Return the eps0 the ServerApp planned for this simulation run from its ``target-epsilon``.

    The ServerApp calibrates eps0 before the first round and writes it to ``<run folder>/plan.json``; a simulated
    client pins that value (the same trust shortcut as the simulation's shared key directory). The plan must be
    for this run config's target epsilon.

    Raises:
        ValueError: no plan yet, a plan for another target, or an eps0 that is not a finite number > 0.
    """
    folder = run_folder(str(run_config.get("output-dir", "outputs") or "outputs"),
                        str(run_config.get("run-name", "") or ""), run_id, base=base)
    path = folder / PLAN_FILE
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"run config 'target-epsilon' is set but {path} does not exist yet: the ServerApp writes "
                         "it before the first round") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the run's plan {path}: {exc}") from None
    target = run_config.get("target-epsilon")
    planned_for = plan.get("target_epsilon") if isinstance(plan, dict) else None
    if planned_for != target:
        raise ValueError(f"the plan {path} is for target epsilon {planned_for!r}, this run config's is {target!r}")
    eps0 = plan.get("eps0")
    if isinstance(eps0, bool) or not isinstance(eps0, (int, float)) or not math.isfinite(eps0) or eps0 <= 0:
        raise ValueError(f"the plan {path} has no usable eps0 (a finite number > 0), got {eps0!r}")
    return float(eps0)
