"""Heap tuning (shuffler/heap.py): glibc stops mapping fresh pages for every megabyte message, a refusal is
reported (never raised or hidden), and the service applies it from its config."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shuffledp.shuffler import heap
from shuffledp.shuffler.process import ShufflerProcess

from .conftest import write_config

# Allocate and free 1 MiB objects many times and report the minor page faults it caused. With glibc's defaults
# the heap's top is trimmed after each round and faulted back in at the next (about 480 faults per round
# measured here); tuned, the heap is reused. Transparent huge pages are turned off for the process, so that a
# host with THP "always" does not hide the faults.
_FAULTS = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    from shuffledp.shuffler import heap
    result = heap.tune_heap(2 << 20) if sys.argv[1] == "tuned" else None
    again = heap.tune_heap(4 << 20) if result is not None else None
    payload = bytes(1 << 20)
    bytes(bytearray(payload))  # first use may grow the heap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):
        bytes(bytearray(payload))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"faults": faults, "result": None if result is None else result.__dict__,
                      "same": again is result}))
    """
)

_IS_GLIBC = heap._mallopt() is not None


@pytest.fixture(autouse=True)
def _no_operator_malloc_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc's malloc parameters set in the environment make tune_heap step aside; these tests need it to act."""
    for name in heap._OPERATOR_ENV:
        monkeypatch.delenv(name, raising=False)


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                         check=True)  # the autouse fixture removed any operator settings: glibc's defaults
    return json.loads(out.stdout)


@pytest.mark.skipif(not _IS_GLIBC, reason="heap tuning applies to glibc only")
def test_tuned_heap_reuses_memory_instead_of_faulting_in_fresh_pages() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    # 200 rounds of two 1 MiB objects: at least half a MiB (128 pages) faulted back in per round by default
    assert default["faults"] > 200 * 128, default
    assert tuned["faults"] < default["faults"] / 20, (default, tuned)
    res = tuned["result"]
    assert res["applied"] is True and res["reason"] == ""
    assert res["mmap_threshold"] == (2 << 20) + 64 * 1024 and res["trim_threshold"] == heap.DEFAULT_TRIM_THRESHOLD
    assert tuned["same"] is True  # a second call changes nothing and returns the first result


def test_mallopt_parameter_numbers_are_glibcs() -> None:
    assert (heap._M_TRIM_THRESHOLD, heap._M_MMAP_THRESHOLD) == (-1, -3)  # <malloc.h>


def test_thresholds_are_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_mallopt", lambda: mallopt)
    res = heap.tune_heap(1 << 30)  # a 1 GiB message limit: the mmap threshold stops at glibc's maximum
    assert res.applied and res.mmap_threshold == heap.MMAP_THRESHOLD_MAX
    assert calls == [(heap._M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_MAX),
                     (heap._M_TRIM_THRESHOLD, heap.DEFAULT_TRIM_THRESHOLD)]
    monkeypatch.setattr(heap, "_applied", None)
    calls.clear()
    assert heap.tune_heap(1000).mmap_threshold == 1 << 20  # small limits still cover a 1 MiB buffer
    assert calls[0] == (heap._M_MMAP_THRESHOLD, 1 << 20)


@pytest.mark.parametrize(
    "refuse,fragment,mmap_set",
    [({heap._M_MMAP_THRESHOLD}, "refused mallopt(M_MMAP_THRESHOLD", 0),
     ({heap._M_TRIM_THRESHOLD}, "refused mallopt(M_TRIM_THRESHOLD", (1 << 20) + 64 * 1024)],
)
def test_a_refusal_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, refuse: set[int], fragment: str,
                                          mmap_set: int) -> None:
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: 0 if param in refuse else 1)
    res = heap.tune_heap(1 << 20)
    assert not res.applied and fragment in res.reason and res.mmap_threshold == mmap_set
    assert res.describe().startswith("heap tuning not applied: ")


@pytest.mark.parametrize("var", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"])
def test_operator_settings_in_the_environment_are_left_alone(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: calls.append(param) or 1)
    monkeypatch.setenv(var, "glibc.malloc.trim_threshold=1" if var == "GLIBC_TUNABLES" else "1048576")
    res = heap.tune_heap(1 << 20)
    assert not res.applied and var in res.reason and calls == []


def test_not_glibc_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_mallopt", lambda: None)
    res = heap.tune_heap(1 << 20)
    assert not res.applied and "not glibc" in res.reason


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_bad_message_size_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_message_bytes must be a positive int"):
        heap.tune_heap(bad)  # type: ignore[arg-type] - the wrong type on purpose


@pytest.mark.parametrize("trim", [1 << 20, 1 << 31, 1 << 33])
def test_trim_threshold_outside_its_range_is_refused(trim: int) -> None:
    # below the mmap threshold (1 MiB + 64 KiB here), or beyond a C int (which mallopt would truncate)
    with pytest.raises(ValueError, match="trim_threshold must be an int in"):
        heap.tune_heap(1 << 20, trim_threshold=trim)


@pytest.mark.skipif(not _IS_GLIBC, reason="heap tuning applies to glibc only")
@pytest.mark.parametrize("tuning", [True, False])
def test_service_applies_heap_tuning_from_its_config(kit, tmp_path: Path, tuning: bool) -> None:
    cfg = write_config(kit, tmp_path / "shuffler.toml", insecure=True)
    cfg.write_text(f"heap_tuning = {'true' if tuning else 'false'}\n" + cfg.read_text())
    proc = ShufflerProcess(cfg, log_path=tmp_path / "shuffler.log")
    with proc:
        pass
    log = (tmp_path / "shuffler.log").read_text()
    limit_mib = ((1 << 20) + 1024 + 64 * 1024) / 1024**2  # max_envelope_bytes + framing slack, + 64 KiB
    if tuning:
        assert f"heap tuning: glibc mmap threshold {limit_mib:.2f} MiB, trim threshold 256.00 MiB" in log
    else:
        assert "heap tuning off (heap_tuning = false)" in log and "glibc mmap threshold" not in log
