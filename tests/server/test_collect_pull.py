"""The collection pulls replies a slice of ids at a time, so it never holds more than one pull's replies."""

from __future__ import annotations

import gc
import weakref

from shuffledp.server import collect


class _Reply:
    def __init__(self, mid: str) -> None:
        self.mid = mid


class _Grid:
    """Answers every id it is asked about, and records each pull's size and the replies still alive."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.made: list[weakref.ref] = []

    def pull_messages(self, ids: set[str]) -> list[_Reply]:
        self.asked.append(len(ids))
        out = [_Reply(i) for i in sorted(ids)]
        self.made += [weakref.ref(r) for r in out]
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.made)


def test_pulled_asks_per_slice_and_holds_one_pull_at_a_time() -> None:
    grid = _Grid()
    ids = [str(i) for i in range(25)]
    got, alive = [], []
    for reply in collect.pulled(grid, ids, 10):
        got.append(reply.mid)
        del reply
        alive.append(grid.alive())
    assert grid.asked == [10, 10, 5]
    assert sorted(got) == sorted(ids)
    assert max(alive) <= 10  # never more than one pull's replies alive

