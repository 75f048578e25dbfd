"""The base class of the bound families (:class:`Family`) and lazy access to the numerical modules.

A family is one object holding its name, kind, validity rule and formulas; the registry of all families is
:mod:`shuffledp.accounting.families`. Standard library only when loaded: the numerical modules (the PLD engine
imports dp_accounting) are imported on first use, so ``import shuffledp.accounting`` stays light.
"""

from __future__ import annotations

from typing import Any

from shuffledp.accounting.core import RefusedError

__all__ = ["Family", "Details", "Items"]

#: What a family's method returns next to its value (JSON-friendly).
Details = dict[str, Any]
#: Groups of equal rounds, ``(n, eps0, count)`` each.
Items = list[tuple[int, float, int]]


# Lazy access to the numerical modules (the PLD engine imports dp_accounting; the package import stays light).
def _lit() -> Any:
    from shuffledp.accounting import literature

    return literature


def _rdp() -> Any:
    from shuffledp.accounting import rdp

    return rdp


def _clones() -> Any:
    from shuffledp.accounting import clones

    return clones


def _pld() -> Any:
    from shuffledp.accounting import pld

    return pld


def _comp() -> Any:
    from shuffledp.accounting import composition

    return composition


class Family:
    """One bound family. Subclasses set the class attributes and implement the methods they support.

    Attributes:
        name: the family's name (a key of :data:`REGISTRY`).
        kind: ``"upper"``, ``"approximate"`` or ``"lower"``.
        eps_delta: whether the family gives (eps, delta) values (False: Renyi divergences only; such a family is
            not in :data:`FAMILIES`, and :attr:`eps_delta_refusal` says why).
        has_renyi: whether :meth:`renyi` gives a Renyi divergence.
        capped: whether its epsilon/delta is capped by the ``no-shuffle`` value (every upper or approximate
            family but ``no-shuffle`` itself: the shuffled output is a post-processing of the reports).
        bucketed: heterogeneous rounds may be moved to dominating grid points so that rounds merge.
        merge_by_eps0: heterogeneous rounds are grouped by eps0 alone (n plays no role).
        mechanism: the local randomizer the family's derivation covers: ``""`` for every eps0-LDP randomizer (the
            generic families), else the name of the one mechanism (``"laplace"``: the project's discrete Laplace
            randomizer; ``"duchi"``: its Duchi et al. mechanism); such a family may enforce a budget only for
            reports produced by that mechanism.
        restriction: the sentence printed next to the values of a mechanism-specific family.
    """

    name: str = ""
    kind: str = "upper"
    eps_delta: bool = True
    eps_delta_refusal: str = ""
    has_renyi: bool = False
    capped: bool = True
    bucketed: bool = False
    merge_by_eps0: bool = False
    mechanism: str = ""
    restriction: str = ""

    def check(self, eps0: float, n: int, delta: float, allow_approximate: bool) -> None:
        """The validity rule: raise :class:`RefusedError` (saying why) where the family refuses one round.

        Args:
            eps0: local privacy parameter.
            n: reports per round.
            delta: the delta the value is asked at.
            allow_approximate: let CLT families answer where their rule would refuse.
        """

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Epsilon at ``delta`` after ``rounds`` equal rounds (parameters already validated).

        Args:
            eps0: local privacy parameter.
            n: reports per round.
            delta: 0 < delta < 1.
            rounds: number of rounds, >= 1.
            allow_approximate: let CLT families answer where their rule would refuse.

        Returns:
            ``(value, details)``, uncapped.
        """
        raise NotImplementedError(self.name)

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Delta at ``epsilon`` after ``rounds`` equal rounds (parameters already validated).

        Args:
            eps0: local privacy parameter.
            n: reports per round.
            epsilon: finite, >= 0.
            rounds: number of rounds, >= 1.
            allow_approximate: let CLT families answer where their rule would refuse.

        Returns:
            ``(value, details)``, uncapped.
        """
        raise NotImplementedError(self.name)

    def renyi(self, eps0: float, n: int, order: float) -> float:
        """One round's Renyi divergence of order ``order`` (only where :attr:`has_renyi`).

        Args:
            eps0: local privacy parameter.
            n: reports per round.
            order: the Renyi order, > 1.

        Returns:
            The divergence.
        """
        raise RefusedError(f"{self.name} has no Renyi-divergence curve")

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """Epsilon at ``delta`` after groups of rounds with different ``(n, eps0)``.

        Args:
            items: ``(n, eps0, count)`` per group (at least two groups).
            total: the number of rounds, ``sum(count)``.
            delta: 0 < delta < 1.
            allow_approximate: let CLT families answer where their rule would refuse.

        Returns:
            ``(value, details)``, uncapped.
        """
        raise NotImplementedError(self.name)
