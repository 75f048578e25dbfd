"""What a round test reads back: the round ids in an engine's ledger and the real shuffler's counters."""

from __future__ import annotations

from typing import Any


def _ledger_rounds(engine: Any) -> list[int]:
    return [row["round"] for row in engine.ledger.rows()]


def _stats(h: Any) -> dict[str, Any]:
    return h.shuffler.stats()
