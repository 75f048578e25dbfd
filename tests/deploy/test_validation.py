"""shuffledp.deploy.validation: each check names the flag, what it got and what is allowed."""

from __future__ import annotations

import pytest

from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.validation import (
    check_int,
    check_isolation,
    check_positive,
    check_reply_floor,
    check_work_limits,
)


def test_good_values_are_returned_normalised() -> None:
    assert check_int("--nodes", 3, 1, 10) == 3
    assert check_positive("--eps0", 2) == 2.0 and isinstance(check_positive("--eps0", 2), float)
    assert check_reply_floor(0) == 0.0
    assert check_work_limits(1, 1, 1) == (1, 1, 1)
    assert check_isolation("--isolation", "process") == "process"


@pytest.mark.parametrize("call, message", [
    (lambda: check_int("--nodes", 0, 1, 10), "--nodes must be an integer in [1, 10], got 0"),
    (lambda: check_int("--nodes", True, 0, 10), "--nodes must be an integer in [0, 10], got True"),
    (lambda: check_positive("--eps0", float("nan")), "--eps0 must be a finite number > 0, got nan"),
    (lambda: check_reply_floor(-1), "--reply-floor must be a number of seconds in [0, 3600], got -1"),
    (lambda: check_work_limits(1, 0, 1), "--min-batch-size must be an integer in [1, "),
    (lambda: check_isolation("--isolation", "thread"), "--isolation must be 'subprocess' or 'process', got 'thread'"),
])
def test_a_bad_value_is_a_usage_error_naming_what_is_allowed(call, message: str) -> None:
    with pytest.raises(DeployUsageError) as info:
        call()
    assert message in str(info.value)
    assert isinstance(info.value, DeployError)  # `shuffledp deploy` exits 2 for it, 1 for any other DeployError
