"""The registry of bound families: one object per family, in the spirit of Google ``dp_accounting``'s one class
per mechanism.

Each :class:`Family` holds everything about one family: its name, its kind (``upper``, ``approximate`` or
``lower``, see :data:`shuffledp.accounting.core.KINDS`), its validity rule (:meth:`Family.check`: when it refuses,
and why), and its epsilon, delta, Renyi divergence (where it has one) and heterogeneous composition. The public
functions of :mod:`shuffledp.accounting.bounds` validate the parameters, look the family up here and apply what is
common to all (the ``no-shuffle`` cap, the grouping of rounds). The classes live in
:mod:`shuffledp.accounting.families_pld` (families composed through privacy loss distributions) and
:mod:`shuffledp.accounting.families_analytic` (closed-form GDP and RDP curves), on the base class of
:mod:`shuffledp.accounting.family_base`.

Adding a family: write one subclass of :class:`Family` (name, kind, flags, :meth:`Family.check` and the methods it
supports) and put one instance in :data:`REGISTRY` below. :data:`FAMILIES`, :data:`FAMILY_KINDS`,
:data:`RENYI_FAMILIES` and :data:`CLONE_VARIANTS`, and with them the package's names, the CLI's choices, the
accountant's :data:`~shuffledp.accounting.accountant.GUARANTEE_FAMILIES` and :class:`Bound`'s check, are derived
from it.

The families (kind in brackets):

* ``clones`` [upper]: the stronger clone pair, C ~ Bin(n-1, 2/(e^{eps0}+1)), w = 1/(e^{eps0}+1) (Feldman,
  McMillan, Talwar, "Stronger privacy amplification by shuffling for Renyi and approximate differential
  privacy", SODA 2023, Lemma 3.5 and Thms 3.1/3.2; Wang, Su, Ye, Shokri, Su, "Unified enhancement of privacy
  bounds for mixture mechanisms via f-DP", NeurIPS 2023, seed 003). One round: the exact delta(eps)/eps(delta) of
  the pair (:mod:`shuffledp.accounting.clones`). Several rounds: composition of its pessimistic privacy loss
  distribution (PLD) (:mod:`shuffledp.accounting.pld`). It rests on SODA 2023 Thms 3.1/3.2, whose proof for
  every eps0-LDP randomizer the paper's errata withdraw (they hold for a restricted class of randomizers); no
  counterexample is known, and the project's randomizers are outside the class as reconstructed in
  docs/accounting.md. Kept as a user's choice and as a comparison; ``auto`` never picks it.
* ``clones-focs`` [upper]: the pair of Feldman, McMillan, Talwar, "Hiding among the clones", FOCS 2021,
  C ~ Bin(n-1, e^{-eps0}), Delta ~ Bern(e^{eps0}/(e^{eps0}+1)); same machinery (Chen, Cao, Ge, "Renyi DP in the
  shuffle model: enhanced amplification bounds", ICASSP 2024, seed 000, Thm 1 / Cor. 1). Holds for every
  eps0-LDP randomizer (not among the results the SODA 2023 errata name).
* ``ccg-gdp`` [approximate]: seed 000, Thm 2, mu = 2 e^{eps0/2}/sqrt(n-1); T rounds: sqrt(sum mu^2).
* ``ccg-rdp`` [approximate]: seed 000, Cor. 2, (lambda, 2 e^{eps0} lambda/(n-1))-RDP, summed over rounds,
  converted with the improved conversion (:mod:`shuffledp.accounting.rdp`).
* ``girgis`` [upper], ``girgis-lower`` [lower, Renyi only]: Girgis, Data, Diggavi, Suresh, Kairouz, "On the
  Renyi differential privacy of the shuffle model", CCS 2021, as printed in seed 000, eqs. (5), (6).
* ``fmt`` [upper]: FMT FOCS 2021, Thm 3.1, only inside eps0 <= log(n/(16 log(4/delta))). Several rounds: each
  round is (eps_1, delta_1)-DP at delta_1 = f delta / T, composed exactly by Kairouz, Oh, Viswanath (ICML 2015,
  Thm 3.3), best f of a fixed grid.
* ``rr-lower`` [lower]: exact loss of shuffled binary randomized response, others holding 0. Several rounds:
  PLD composition with OPTIMISTIC discretisation, so the value stays a lower bound.
* ``canonical-gdp`` [approximate]: Shvets, "Universal shuffle asymptotics: JSD and GDP", 2026 (seed 002),
  mu_n = sqrt(chi^2(W_1||W_0)/n) for binary randomized response with eps0; T rounds: sqrt(T) mu_n.
* ``no-shuffle`` [upper]: each report eps0-DP seen by the server, T rounds composed optimally (KOV).
* ``blanket-laplace`` [upper, mechanism-aware]: the privacy blanket of the project's discrete Laplace randomizer
  (Balle, Bell, Gascon, Nissim, CRYPTO 2019), blanket mass e^{-eps0/2}, ratios spread to the corners of
  [e^{-eps0/2}, e^{eps0/2}]^2; pessimistic PLD composition (:mod:`shuffledp.accounting.blanket`). Valid only for
  reports of that randomizer (:data:`FAMILY_MECHANISMS`).
* ``blanket-duchi`` [upper, mechanism-aware]: the privacy blanket of the project's Duchi et al. mechanism: its
  likelihood ratios lie in the box [2/(e^{eps0}+1), 2e^{eps0}/(e^{eps0}+1)], whose corner pair is exactly the
  stronger clone pair, so the numbers are those of ``clones``, rigorous for this mechanism without SODA 2023
  Lemma 3.5 (:class:`~shuffledp.accounting.families_pld.BlanketDuchiFamily`). Valid only for reports of that
  mechanism.
* ``blanket-privunit2`` [upper, mechanism-aware]: the privacy blanket of the project's PrivUnit2, whose eps0 split
  depends on eps0 alone: likelihood ratios in the d-free box [L, e^{eps0} L], L = (1 + e^{-2 eps0/3}) /
  (1 + e^{eps0/3}) (:mod:`shuffledp.accounting.privunit_box`), the same corner pair and composition as
  ``blanket-laplace``. Valid only for reports of that mechanism.

The run config's ``accounting-family = "auto"`` picks, by the run's mechanism, the tightest upper family that is
rigorous for it (:data:`AUTO_FAMILIES`, :func:`resolve_family`).

Each method returns ``(value, details)``; the values are the families' own (uncapped). These modules import only
the standard library and :mod:`shuffledp.accounting.core` when they are loaded (the package imports this one for
:data:`FAMILIES`); the numerical modules are loaded on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.families_analytic import (
    CanonicalGdpFamily,
    CcgGdpFamily,
    CcgRdpFamily,
    GdpFamily,
    GirgisFamily,
    GirgisLowerFamily,
    RdpFamily,
)
from shuffledp.accounting.families_pld import (
    DELTA_SEARCH_FLOOR,
    DELTA_SEARCH_RTOL,
    FMT_DELTA_FRACTIONS,
    BlanketDuchiFamily,
    BlanketLaplaceFamily,
    BlanketPrivUnit2Family,
    CloneFamily,
    FmtFamily,
    NoShuffleFamily,
    RrLowerFamily,
)
from shuffledp.accounting.family_base import Family

__all__ = [
    "Family",
    "CloneFamily",
    "GdpFamily",
    "RdpFamily",
    "REGISTRY",
    "FAMILIES",
    "FAMILY_KINDS",
    "RENYI_FAMILIES",
    "CLONE_VARIANTS",
    "FAMILY_MECHANISMS",
    "AUTO_FAMILY",
    "AUTO_FAMILIES",
    "resolve_family",
    "FMT_DELTA_FRACTIONS",
    "DELTA_SEARCH_RTOL",
    "DELTA_SEARCH_FLOOR",
    "lookup",
]


# ---------------------------------------------------------------------------------------------------------
# The registry (its order is the order of FAMILIES and FAMILY_KINDS)
# ---------------------------------------------------------------------------------------------------------

REGISTRY: Mapping[str, Family] = {
    family.name: family
    for family in (
        CloneFamily("clones", "stronger"),
        CloneFamily("clones-focs", "focs"),
        CcgGdpFamily(),
        CcgRdpFamily(),
        GirgisFamily(),
        GirgisLowerFamily(),
        FmtFamily(),
        RrLowerFamily(),
        CanonicalGdpFamily(),
        NoShuffleFamily(),
        BlanketLaplaceFamily(),
        BlanketPrivUnit2Family(),
        BlanketDuchiFamily(),
    )
}

#: Families with (eps, delta) values, accepted by :mod:`shuffledp.accounting.bounds` (``"girgis-lower"`` is
#: accepted as well where a lower bound of Girgis et al. is meaningful, i.e. for Renyi divergences).
FAMILIES: tuple[str, ...] = tuple(name for name, family in REGISTRY.items() if family.eps_delta)
#: The kind of every family (including ``girgis-lower``).
FAMILY_KINDS: Mapping[str, str] = {name: family.kind for name, family in REGISTRY.items()}
#: Families with a Renyi-divergence curve (:func:`shuffledp.accounting.bounds.renyi`).
RENYI_FAMILIES: tuple[str, ...] = tuple(name for name, family in REGISTRY.items() if family.has_renyi)
#: The clone-pair families and their variant of :mod:`shuffledp.accounting.clones`.
CLONE_VARIANTS: Mapping[str, str] = {
    name: family.variant for name, family in REGISTRY.items() if isinstance(family, CloneFamily)
}

#: The mechanism-specific families and the one local randomizer each covers (``"laplace"``: the project's discrete
#: Laplace randomizer; ``"duchi"``: its Duchi et al. mechanism); every other family holds for any eps0-LDP
#: randomizer (``clones`` under the proviso of its SODA 2023 errata, see the module docstring).
FAMILY_MECHANISMS: Mapping[str, str] = {name: family.mechanism for name, family in REGISTRY.items() if family.mechanism}

#: The run-config value that picks the budget family by mechanism (:func:`resolve_family`).
AUTO_FAMILY = "auto"
#: What ``auto`` resolves to, per mechanism (:data:`shuffledp.clients.mechanism.MECHANISMS`): the tightest upper
#: family that is rigorous for that mechanism without the withdrawn general proof of FMT SODA 2023 Lemma 3.5.
#: ``laplace``: its privacy blanket (Balle et al., CRYPTO 2019); ``duchi``: its blanket, the stronger clone pair;
#: ``privunit2``: its blanket, the box of its eps0 split (:mod:`shuffledp.accounting.privunit_box`).
AUTO_FAMILIES: Mapping[str, str] = {
    "laplace": "blanket-laplace",
    "duchi": "blanket-duchi",
    "privunit2": "blanket-privunit2",
}


def resolve_family(family: str, mechanism: str) -> str:
    """The budget family a run uses: ``family`` itself, or for ``"auto"`` the mechanism's default.

    Args:
        family: a family name or :data:`AUTO_FAMILY`.
        mechanism: the run's local randomizer (a key of :data:`AUTO_FAMILIES`).

    Returns:
        ``family`` unchanged unless it is ``"auto"``; then ``AUTO_FAMILIES[mechanism]`` (blanket-laplace,
        blanket-duchi or blanket-privunit2; see :data:`AUTO_FAMILIES` for why each is rigorous).

    Raises:
        ValueError: ``family`` is ``"auto"`` and ``mechanism`` has no default (the message lists those that do).
    """
    if family != AUTO_FAMILY:
        return family
    if mechanism not in AUTO_FAMILIES:
        raise ValueError(
            f"accounting family 'auto' has no default for mechanism {mechanism!r}; mechanisms with a default: "
            f"{', '.join(f'{m} -> {f}' for m, f in AUTO_FAMILIES.items())}; name a family instead")
    return AUTO_FAMILIES[mechanism]


def lookup(family: Any, *, renyi: bool = False) -> Family:
    """The registered family named ``family``.

    Args:
        family: the family's name.
        renyi: the caller asks for a Renyi divergence (families without (eps, delta) values are accepted).

    Returns:
        The :class:`Family`.

    Raises:
        ValueError: not a registered family name. RefusedError: a Renyi-only family asked for (eps, delta).
    """
    allowed = tuple(REGISTRY) if renyi else FAMILIES
    if not isinstance(family, str) or family not in REGISTRY:
        raise ValueError(f"family must be one of {list(allowed)}, got {family!r}")
    found = REGISTRY[family]
    if not renyi and not found.eps_delta:
        raise RefusedError(found.eps_delta_refusal)
    return found
