"""An empirical privacy audit of the shuffled pipeline: a statistically valid LOWER bound on epsilon, to set beside
the accountant's upper bound (``shuffledp audit privacy``).

Method (Jagielski, Ullman, Oprea, NeurIPS 2020; Nasr, Song, Thakurta, Papernot, Carlini, IEEE S&P 2021):

1. The neighbouring pair: one canary client holds ``+C e1`` (hypothesis a) or ``-C e1`` (b), opposite vertices
   of the L1 clip ball; ``n - 1`` other clients hold a fixed input (:class:`AuditInstance`). One trial is one run
   of ``T`` rounds, the canary in every round with fresh noise each round.
2. The pipeline randomizes every report and the server sees the multiset
   (:mod:`shuffledp.deploy.audit_privacy_pipelines`; :mod:`shuffledp.deploy.audit_privacy_e2e` sends some trials
   through the real shuffler process). A trial's score is the sum of its rounds' scores; for the real Laplace
   randomizer a round's score is the exact log likelihood ratio of its multiset, so the sum is the exact log
   likelihood ratio of the T-round view (the rounds are independent), the most powerful test (Neyman-Pearson).
3. ``trials`` trials per hypothesis; the first ``selection_fraction`` of each are held apart to choose the test's
   direction and threshold (maximising the bound below on them), the rest evaluate it once.
4. On the evaluation trials, one-sided Clopper-Pearson upper bounds on the false-positive and false-negative rates,
   each at level ``alpha / 2`` (Bonferroni: both hold together with probability ``>= 1 - alpha``), give

       eps_lb = log((1 - delta - FNR_upper) / FPR_upper)

   since every (eps, delta)-DP mechanism has ``FPR + e^eps FNR >= 1 - delta`` and the same with the two rates
   swapped. With confidence ``1 - alpha`` the pipeline is not (eps, delta)-DP for any eps < eps_lb.

The trials are i.i.d., so the split is by index; the audit draws no randomness of its own. The noise is drawn by the
pipeline (the real randomizer's CSPRNG; the broken numpy pipeline's own Mersenne Twister, which is its flaw).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
from scipy import optimize
from scipy.stats import beta, norm

from shuffledp.deploy.audit_privacy_pipelines import AuditInstance

__all__ = ["clopper_pearson_upper", "clopper_pearson_lower", "epsilon_lower_bound", "choose_threshold",
           "AuditResult", "run_audit", "check_audit_args", "format_table", "reference_bounds",
           "gaussian_fit_epsilon", "gaussian_audit_expectation", "gdp_mu", "MECHANISM_FAMILIES"]

#: Mechanism-aware accounting families for the discrete Laplace randomizer: shown beside the generic ones when
#: :data:`shuffledp.accounting.FAMILIES` has them.
MECHANISM_FAMILIES = ("blanket-laplace",)


class ScorePipeline(Protocol):
    """What the audit needs of a pipeline (see :mod:`shuffledp.deploy.audit_privacy_pipelines`)."""

    name: str
    broken: bool
    instance: AuditInstance

    @property
    def claimed_eps0(self) -> float:
        """The local epsilon the pipeline claims."""

    def round_scores(self, hyp: str, trials: int) -> np.ndarray:
        """Scores of ``trials`` one-round multisets under hypothesis ``hyp``."""


def clopper_pearson_upper(k: Any, n: Any, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper confidence bound on a binomial proportion (Clopper, Pearson 1934).

    Args:
        k: successes (int or int array), ``0 <= k <= n``.
        n: trials (>= 1).
        alpha: the bound holds with probability ``>= 1 - alpha``.

    Returns:
        ``p_hi`` with ``P[Bin(n, p_hi) <= k] = alpha`` (the ``1 - alpha`` quantile of Beta(k + 1, n - k)); 1 at k = n.
    """
    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        hi = beta.ppf(1.0 - alpha, k + 1.0, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, hi)


def clopper_pearson_lower(k: Any, n: Any, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson lower confidence bound on a binomial proportion.

    Args:
        k: successes, ``0 <= k <= n``.
        n: trials (>= 1).
        alpha: the bound holds with probability ``>= 1 - alpha``.

    Returns:
        The ``alpha`` quantile of Beta(k, n - k + 1); 0 at k = 0.
    """
    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        lo = beta.ppf(alpha, np.maximum(k, 1e-300), n - k + 1.0)
    return np.where(k <= 0, 0.0, lo)


def epsilon_lower_bound(fp: Any, n_neg: int, fn: Any, n_pos: int, delta: float, alpha: float) -> np.ndarray:
    """``log((1 - delta - FNR_upper) / FPR_upper)`` (0 when that is not positive), each rate's Clopper-Pearson
    upper bound at level ``alpha / 2`` (Bonferroni: the bound holds with probability ``>= 1 - alpha``).

    Args:
        fp: false positives among ``n_neg`` trials of the hypothesis the test rejects.
        n_neg: those trials.
        fn: false negatives among ``n_pos`` trials of the other hypothesis.
        n_pos: those trials.
        delta: the delta at which the bound is stated.
        alpha: one minus the confidence.

    Returns:
        The lower bound on epsilon (float array, >= 0).
    """
    fpr = clopper_pearson_upper(fp, n_neg, alpha / 2.0)
    fnr = clopper_pearson_upper(fn, n_pos, alpha / 2.0)
    num = 1.0 - delta - fnr
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.where(num > 0, np.log(np.maximum(num, 1e-300)) - np.log(fpr), 0.0)
    return np.maximum(eps, 0.0)


def _rates(sa: np.ndarray, sb: np.ndarray, t: np.ndarray, direction: str) -> tuple[np.ndarray, np.ndarray]:
    """(false positives, false negatives) of the rule at thresholds ``t``; ``sa``, ``sb`` sorted. Direction
    ``a``: say a when score > t (a false positive is a b-trial said a); ``b``: say b when score < t."""
    if direction == "a":
        return sb.size - np.searchsorted(sb, t, "right"), np.searchsorted(sa, t, "right")
    return np.searchsorted(sa, t, "left"), sb.size - np.searchsorted(sb, t, "left")


def choose_threshold(scores_a: np.ndarray, scores_b: np.ndarray, delta: float, alpha: float,
                     max_candidates: int = 4096) -> tuple[str, int, float, float]:
    """The rule that maximises :func:`epsilon_lower_bound` on the held-apart trials: an orientation ``sign`` (the
    rule reads ``sign * score``), a direction (``a``: say a when ``sign * score > t``, bounding
    ``P_a(S) / P_b(S)``; ``b``: say b when ``sign * score < t``, bounding the ratio the other way) and a threshold.

    Args:
        scores_a: selection trials' scores under hypothesis a.
        scores_b: under b.
        delta: as for the bound.
        alpha: as for the bound.
        max_candidates: thresholds tried per rule (quantiles of the pooled scores' distinct values).

    Returns:
        ``(direction, sign, threshold, bound on the selection trials)``.
    """
    best = ("a", 1, float("inf"), -1.0)
    for sign in (1, -1):
        sa, sb = np.sort(sign * np.asarray(scores_a)), np.sort(sign * np.asarray(scores_b))
        cand = np.unique(np.concatenate([sa, sb]))
        if cand.size > max_candidates:
            cand = cand[np.unique(np.linspace(0, cand.size - 1, max_candidates).astype(np.int64))]
        # thresholds just below/above each distinct value, so that ties fall on the intended side
        cand = np.unique(np.concatenate([cand, np.nextafter(cand, -np.inf), np.nextafter(cand, np.inf)]))
        for direction in ("a", "b"):
            fp, fn = _rates(sa, sb, cand, direction)
            n_neg, n_pos = (sb.size, sa.size) if direction == "a" else (sa.size, sb.size)
            eps = epsilon_lower_bound(fp, n_neg, fn, n_pos, delta, alpha)
            i = int(np.argmax(eps))
            if eps[i] > best[3]:
                best = (direction, sign, float(cand[i]), float(eps[i]))
    return best


def gaussian_fit_epsilon(scores_a: np.ndarray, scores_b: np.ndarray, delta: float) -> float:
    """An ESTIMATE (not a bound) of the audited instance's epsilon at ``delta``: the privacy-loss scores are fitted
    by mu-Gaussian DP (under a the loss is N(mu^2/2, mu^2); Dong, Roth, Su 2022), ``mu`` = the pooled standard
    deviation, and ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` is solved for eps.

    Args:
        scores_a: exact log likelihood ratios under a.
        scores_b: under b.
        delta: the delta.

    Returns:
        The estimate (0 when mu is 0).
    """
    mu = math.sqrt(0.5 * (float(np.var(scores_a)) + float(np.var(scores_b))))
    if mu <= 0:
        return 0.0

    def gap(eps: float) -> float:
        return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)) - delta

    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0:
        hi *= 2.0
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-10))


def gaussian_audit_expectation(mu: float, evaluation_trials: float, delta: float, confidence: float) -> float:
    """The lower bound this audit would give if the trial scores were exactly mu-GDP (under b ``N(0, 1)``, under a
    ``N(mu, 1)``, the counts at their expected values) with the best threshold: what the trial count alone lets the
    audit certify for an instance of that privacy. Used to say how many trials a target bound needs.

    Args:
        mu: the GDP parameter (e.g. of :func:`gaussian_fit_epsilon`'s fit).
        evaluation_trials: evaluation trials per hypothesis.
        delta: the delta of the bound.
        confidence: as for :func:`run_audit`.

    Returns:
        The bound (>= 0).
    """
    z = np.linspace(-3.0, 8.0, 8001)
    fp = np.floor(evaluation_trials * norm.sf(z))
    fn = np.floor(evaluation_trials * norm.cdf(z - mu))
    return float(np.max(epsilon_lower_bound(fp, evaluation_trials, fn, evaluation_trials, delta, 1.0 - confidence)))


def gdp_mu(eps: float, delta: float) -> float:
    """The mu of the mu-GDP curve that passes through ``(eps, delta)`` (Dong, Roth, Su 2022, Cor. 2.13).

    Returns:
        mu > 0.
    """
    def gap(mu: float) -> float:
        return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)) - delta

    return float(optimize.brentq(gap, 1e-6, 100.0))


@dataclass
class AuditResult:
    """One audit's outcome (JSON-safe with :meth:`as_dict`)."""

    pipeline: str
    broken: bool
    eps0: float
    n: int
    rounds: int
    others: str
    dim: int
    delta: float
    confidence: float
    trials: int  # per hypothesis, selection and evaluation together
    selection_trials: int
    direction: str  # "a": the rule says a when sign * score > threshold; "b": says b when sign * score < threshold
    sign: int
    threshold: float
    false_positives: int
    false_negatives: int
    evaluation_trials: int
    fpr_upper: float
    fnr_upper: float
    epsilon_lower: float  # the audit's lower bound at (delta, confidence)
    ceiling: float  # the largest bound these evaluation counts could give (no error at all)
    epsilon_point: float | None  # log((1 - delta - FNR)/FPR) on the raw evaluation rates (no confidence)
    gaussian_fit: float | None  # estimate of the instance's epsilon (real Laplace, n e^-eps0 >= 10; not a bound)
    claimed_eps0: float
    references: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-safe dict."""
        return asdict(self)


def reference_bounds(eps0: float, n: int, delta: float, rounds: int) -> dict[str, dict[str, Any]]:
    """The accountant's values for ``rounds`` rounds of ``n`` shuffled ``eps0``-LDP reports: ``clones`` (upper),
    ``rr-lower`` (a lower bound for generic accounting, attained by randomized response), ``no-shuffle``, and each
    of :data:`MECHANISM_FAMILIES` that :data:`shuffledp.accounting.FAMILIES` has.

    Args:
        eps0: the local epsilon the reports are credited with.
        n: reports per round.
        delta: the delta.
        rounds: T.

    Returns:
        ``{family: {"value": float | None, "kind": str, "error": str (only when it refused)}}``.
    """
    from shuffledp.accounting import FAMILIES
    from shuffledp.accounting.bounds import epsilon

    names = ["clones", "rr-lower", "no-shuffle"] + [f for f in MECHANISM_FAMILIES if f in FAMILIES]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            b = epsilon(name, eps0, n, delta, rounds)
            out[name] = {"value": float(b.value), "kind": b.kind}
        except Exception as exc:  # noqa: BLE001 - a family that refuses is shown as such, not fatal
            out[name] = {"value": None, "kind": "", "error": f"{type(exc).__name__}: {exc}"}
    return out


def check_audit_args(rounds: int, trials: int, delta: float, confidence: float, selection_fraction: float) -> None:
    """Raises ValueError naming the first of :func:`run_audit`'s parameters that is out of range."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= 10_000:
        raise ValueError(f"rounds must be an int in [1, 10000], got {rounds!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or not 20 <= trials <= 100_000_000:
        raise ValueError(f"trials must be an int in [20, 1e8] (per hypothesis), got {trials!r}")
    if not (isinstance(delta, float) and 0.0 <= delta < 1.0):
        raise ValueError(f"delta must be a float in [0, 1), got {delta!r}")
    if not (isinstance(confidence, float) and 0.5 <= confidence < 1.0):
        raise ValueError(f"confidence must be a float in [0.5, 1), got {confidence!r}")
    if not 0.05 <= selection_fraction <= 0.95:
        raise ValueError(f"selection_fraction must be in [0.05, 0.95], got {selection_fraction!r}")


def run_audit(pipeline: ScorePipeline, *, rounds: int = 1, trials: int = 2000, delta: float = 1e-6,
              confidence: float = 0.95, selection_fraction: float = 0.5, references: bool = True) -> AuditResult:
    """Run the audit (module docstring) on ``pipeline``.

    Args:
        pipeline: the randomizer pipeline and its instance.
        rounds: T, rounds per trial (the canary in every round).
        trials: trials per hypothesis (selection and evaluation together).
        delta: the delta of the bound.
        confidence: ``1 - alpha``, for the bound as a whole (split over the two rates).
        selection_fraction: the share of each hypothesis's trials held apart to choose the test.
        references: also compute the accountant's values (:func:`reference_bounds`).

    Returns:
        The :class:`AuditResult`.

    Raises:
        ValueError: a parameter out of range.
    """
    import time

    check_audit_args(rounds, trials, delta, confidence, selection_fraction)
    alpha = 1.0 - confidence
    start = time.perf_counter()
    scores = {}
    for hyp in ("a", "b"):
        total = np.zeros(trials)
        for _ in range(rounds):
            total += pipeline.round_scores(hyp, trials)
        scores[hyp] = total
    n_sel = int(round(trials * selection_fraction))
    n_sel = min(max(n_sel, 10), trials - 10)
    direction, sign, threshold, _ = choose_threshold(scores["a"][:n_sel], scores["b"][:n_sel], delta, alpha)
    ea, eb = np.sort(sign * scores["a"][n_sel:]), np.sort(sign * scores["b"][n_sel:])
    fp, fn = _rates(ea, eb, np.array([threshold]), direction)
    n_eval = trials - n_sel
    eps_lb = float(epsilon_lower_bound(fp, n_eval, fn, n_eval, delta, alpha)[0])
    ceiling = float(epsilon_lower_bound(0, n_eval, 0, n_eval, delta, alpha))
    fpr, fnr = int(fp[0]) / n_eval, int(fn[0]) / n_eval
    point = math.log((1 - delta - fnr) / fpr) if fpr > 0 and 1 - delta - fnr > 0 else None
    inst = pipeline.instance
    # the Gaussian fit only where many reports act as cover (the loss is then close to Gaussian)
    lr_scores = pipeline.name == "laplace" and inst.n * math.exp(-inst.eps0) >= 10
    refs = reference_bounds(pipeline.claimed_eps0, inst.n, delta, rounds) if references else {}
    return AuditResult(
        pipeline=pipeline.name, broken=bool(pipeline.broken), eps0=inst.eps0, n=inst.n, rounds=rounds,
        others=inst.others, dim=inst.dim, delta=delta, confidence=confidence, trials=trials, selection_trials=n_sel,
        direction=direction, sign=sign, threshold=threshold, false_positives=int(fp[0]), false_negatives=int(fn[0]),
        evaluation_trials=n_eval,
        fpr_upper=float(clopper_pearson_upper(fp[0], n_eval, alpha / 2)),
        fnr_upper=float(clopper_pearson_upper(fn[0], n_eval, alpha / 2)),
        epsilon_lower=eps_lb, ceiling=ceiling, epsilon_point=point,
        gaussian_fit=gaussian_fit_epsilon(scores["a"], scores["b"], delta) if lr_scores else None,
        claimed_eps0=float(pipeline.claimed_eps0), references=refs, seconds=time.perf_counter() - start,
    )


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_table(results: list[AuditResult]) -> str:
    """The results as the table ``shuffledp audit privacy`` prints (one row per audit).

    Columns: the setting, the audit's lower bound (kind ``lower (empirical)``), its ceiling at these trial counts,
    the Gaussian-fit estimate (``~``: an estimate, no bound), then each accountant family with its kind.

    Returns:
        The text, ending with a newline.
    """
    fams: list[str] = []
    for r in results:
        fams += [f for f in r.references if f not in fams]
    head = ["pipeline", "others/d", "eps0", "n", "T", "trials", "FP/FN (eval)", "audit lb", "ceiling", "~gauss-fit"]
    head += [f"{f} ({next((r.references[f]['kind'] for r in results if r.references.get(f, {}).get('kind')), '?')})"
             for f in fams]
    rows = []
    for r in results:
        row = [r.pipeline, f"{r.others}/{r.dim}", f"{r.eps0:g}", str(r.n), str(r.rounds), str(r.trials),
               f"{r.false_positives}/{r.false_negatives} of {r.evaluation_trials}", _fmt(r.epsilon_lower),
               _fmt(r.ceiling, 2), _fmt(r.gaussian_fit)]
        row += [_fmt(r.references.get(f, {}).get("value")) for f in fams]
        rows.append(row)
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    if results:
        r0 = results[0]
        lines.append(f"audit lb: lower bound on epsilon at delta={r0.delta:g}, confidence {r0.confidence:g} "
                     f"(Clopper-Pearson, each rate at {(1 - r0.confidence) / 2:g}); ~gauss-fit: an estimate of the "
                     "audited instance, no bound; accountant families at the claimed eps0")
    return "\n".join(lines) + "\n"
