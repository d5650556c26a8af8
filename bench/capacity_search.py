"""Which rates a capacity run measures: the search (double until a miss, then bisect to --precision) or a
uniform sweep (--finer-sweep, centred on an earlier search's answer), and the --budget-s rule for starting a point."""

from __future__ import annotations

import math

from ansible_collections.b300.pd.bench.capacity_fit import context_fit
from ansible_collections.b300.pd.bench.capacity_plan import UsageError
from ansible_collections.b300.pd.bench.capacity_prometheus import PROM_QUERIES


def capacity_search(measure, start_rate: float, precision: float, min_rate: float, max_points: int):
    """Highest rate r with measure(r) True, to relative precision (hi/lo - 1 <= precision).

    measure(rate) -> bool must be (about) monotone: True below the knee, False above. Returns
    (max_rate or 0.0 when even min_rate fails, first failing rate or None, [(rate, passed), ...]).
    """
    if start_rate <= 0 or precision <= 0 or min_rate <= 0:
        raise UsageError("--start-rate, --precision and --min-rate must be > 0")
    points: list[tuple[float, bool]] = []

    def probe(rate):
        ok = bool(measure(rate))
        points.append((rate, ok))
        return ok

    lo = hi = None
    rate = start_rate
    if probe(rate):
        lo = rate
        while len(points) < max_points:
            rate *= 2.0
            if probe(rate):
                lo = rate
            else:
                hi = rate
                break
    else:
        hi = rate
        while len(points) < max_points:
            rate /= 2.0
            if rate < min_rate:
                return 0.0, hi, points
            if probe(rate):
                lo = rate
                break
            hi = rate
    if lo is None:
        return 0.0, hi, points
    while hi is not None and hi / lo - 1.0 > precision and len(points) < max_points:
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi, points


class BudgetSpent(Exception):
    """The next point could end past --budget-s, or take the time kept for a later context's first point."""


def point_worst_s(point_timeout: float, prometheus_url: str, prometheus_timeout: float) -> float:
    """The longest one point can take: its client killed at --point-timeout, or its run plus the Prometheus
    read-back (every query bounded by --prometheus-timeout)."""
    return point_timeout + (len(PROM_QUERIES) * prometheus_timeout if prometheus_url else 0.0)


def budget_allows(elapsed_s: float, worst_s: float, contexts_after: int, budget_s: float | None) -> bool:
    """Start the next point only if it ends within the budget at its worst, with one worst-case point still left
    for each later context length (every context length gets measured)."""
    return budget_s is None or elapsed_s + worst_s * (1 + contexts_after) <= budget_s


def knee_of_sweep(results: list[tuple[float, bool]]) -> float:
    """The knee of a uniform sweep: the highest rate passing below the first failing rate (0.0 if none)."""
    knee = 0.0
    for rate, ok in sorted(results):
        if not ok:
            break
        knee = rate
    return knee


def sweep_centre(search: dict, ctx: int, how: str, sla: dict, window: float) -> dict:
    """The rate a finer sweep of one context is centred on: the search's SLA crossing (its answer; a sweep around
    the highest passing rate with factors 0.9-1.2 ended below the crossing and had to extrapolate its own, 2026-12-06)
    or, with how="max-rate" or without a crossing, its highest passing rate."""
    found = next((c for c in search.get("contexts", []) if c["context"] == ctx), None)
    if found is None:
        raise UsageError(f"--compare-with: the search report has no context {ctx} (it has "
                         f"{', '.join(str(c['context']) for c in search.get('contexts', [])) or 'none'}); "
                         "use --contexts with its context lengths")
    if how == "crossing":
        crossing = context_fit(found, search.get("sla") or sla, window).get("rate")
        if crossing:
            return {"rate": crossing, "from": "SLA crossing"}
    if not found.get("max_rate"):
        raise UsageError(f"--compare-with: the search found no passing rate at {ctx} tokens and no SLA crossing, so "
                         "there is nothing to sweep around; give --sweep-min and --sweep-max")
    return {"rate": found["max_rate"], "from": "max rate"}


def sweep_rates(lo: float, hi: float, points: int) -> list[float]:
    if points < 2 or lo <= 0 or hi <= lo:
        raise UsageError("--finer-sweep needs --sweep-points >= 2 and 0 < --sweep-min < --sweep-max")
    step = (hi - lo) / (points - 1)
    return [round(lo + i * step, 4) for i in range(points)]
