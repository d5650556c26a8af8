"""The SLA crossing of a capacity run: the rate where a line through every point's log SLA ratio against log
rate reaches 1, with a bootstrap interval; and the comparison of a search with a finer sweep (verdicts and fits)."""

from __future__ import annotations

import math
import random

# How many resamples give the crossing's 90 % interval (percentile bootstrap over the points; seeded, so a report
# re-rendered from the same points shows the same interval).
FIT_BOOTSTRAP = 400
FIT_MIN_POINTS = 4


def sla_ratio(point: dict, sla: dict) -> float | None:
    """How far one point is from the SLA: the larger of mean TTFT / its limit and mean TPOT / its limit (1.0 = at
    the limit). None for a point without that size: failed requests, no latencies, or timed out (a miss, counted in
    the verdicts, but not a figure to fit)."""
    if point.get("timed_out") or point.get("failed") or point.get("mean_ttft_ms") is None \
            or point.get("mean_tpot_ms") is None:
        return None
    return max(point["mean_ttft_ms"] / sla["ttft_mean_ms"], point["mean_tpot_ms"] / sla["tpot_mean_ms"])


def loglog_crossing(pairs: list[tuple[float, float]]) -> float | None:
    """The rate where a least-squares line through (log rate, log SLA ratio) reaches ratio 1; None when the points
    have one rate only or the line does not rise with the rate (noise larger than the trend)."""
    xs = [math.log(rate) for rate, _ratio in pairs]
    ys = [math.log(ratio) for _rate, ratio in pairs]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:
        return None
    return math.exp(mean_x - mean_y / slope)


def sla_crossing(points: list[dict], sla: dict, lo: float, hi: float | None, window: float) -> dict:
    """The rate at which the SLA is just met, estimated from every point near the knee instead of the pass/fail
    verdict of the two rates that bracket it.

    Near the knee one rate's points spread +-30 % in mean TPOT on shared cores, so which of two rates 5 % apart
    passes is partly chance, and the highest passing rate moves by a bracket step with it. Every point also says by
    how much it met or missed the SLA (`sla_ratio`); a line through log ratio against log rate, fitted to all points
    whose rate lies within `window` x the bracket [lo, hi] (lo: the highest passing rate, hi: the first failing
    one), reaches ratio 1 at the estimate. The window keeps far-overloaded points (queues growing, ratios of 10-100)
    out of the line. 90 % interval: percentile bootstrap over the same points."""
    if hi is None:
        return {"rate": None, "why": "no failing rate: the capacity is above the highest rate measured"}
    low_end = (lo if lo and lo > 0 else hi) / window
    pairs = [(p["rate"], r) for p in points
             if low_end <= p["rate"] <= hi * window and (r := sla_ratio(p, sla)) is not None and r > 0]
    if len({rate for rate, _ratio in pairs}) < 2:
        return {"rate": None, "why": f"fewer than 2 measured rates within {window:g}x of the bracket"}
    est = loglog_crossing(pairs)
    if est is None:
        return {"rate": None, "why": "the SLA ratio does not rise with the rate near the knee (noise)",
                "points": len(pairs)}
    rates = [rate for rate, _ratio in pairs]
    if not min(rates) / window <= est <= max(rates) * window:
        # a nearly flat line reaches the limit anywhere (2026-12-06: a sweep whose every rate from 40.7 to 54.3 req/s
        # failed, medians 17.6-36.8 ms without a trend, "crossed" at 0.002 req/s): no estimate, only a bound
        return {"rate": None, "points": len(pairs), "line_crossing": round(est, 4),
                "why": f"the line through the points reaches the limit at {est:.3g} req/s, beyond {window:g}x of the "
                       f"rates measured ({min(rates):.3g}-{max(rates):.3g}): no trend near the knee"}
    rng = random.Random(0)  # noqa: S311 - a bootstrap, not a secret; seeded so a re-render shows the same interval
    resampled = sorted(e for e in (loglog_crossing([rng.choice(pairs) for _pair in pairs])
                                   for _round in range(FIT_BOOTSTRAP))
                       if e is not None)
    # a bootstrap of 2 or 3 points says nothing (2 points: every resample with both rates is the same line, an
    # interval of width 0): no interval below FIT_MIN_POINTS
    ci90 = ([round(resampled[int(0.05 * len(resampled))], 4), round(resampled[int(0.95 * len(resampled)) - 1], 4)]
            if len(pairs) >= FIT_MIN_POINTS and len(resampled) >= FIT_BOOTSTRAP // 2 else None)
    return {"rate": round(est, 4), "ci90": ci90, "points": len(pairs), "rates": [min(rates), max(rates)],
            "extrapolated": not min(rates) <= est <= max(rates)}


def context_fit(context: dict, sla: dict, window: float) -> dict:
    """The SLA crossing of one report context from its own points and bracket."""
    return sla_crossing(context.get("points", []), sla, context["max_rate"], context.get("fail_rate"), window)


def add_fits(rep: dict, window: float) -> None:
    """Each context of a report gets its SLA crossing (`fit`) from its own points."""
    for c in rep["contexts"]:
        c["fit"] = context_fit(c, rep["sla"], window)


def _rel(value, reference):
    """(value - reference) / reference; None when either is missing or the reference is 0 (a search max rate of 0
    against a knee stays -100 %, as before the fits)."""
    return (value - reference) / reference if value is not None and reference else None


def compare(search: dict, sweep: dict, window: float) -> list[dict]:
    """Search against sweep, per context length of both: the search's max rate against the sweep's knee (the
    verdicts), and the search's SLA crossing against the sweep's (the fits, both from their own points with the same
    window; a search report of an older version without fits gets them here)."""
    rows = []
    by_ctx = {c["context"]: c for c in search["contexts"]}
    for c in sweep["contexts"]:
        found = by_ctx.get(c["context"])
        if found is None:
            continue
        search_fit = context_fit(found, search.get("sla", sweep["sla"]), window)
        sweep_fit = context_fit(c, sweep["sla"], window)
        rows.append({"context": c["context"], "search_max_rate": found["max_rate"], "knee": c["max_rate"],
                     "rel_diff": _rel(found["max_rate"], c["max_rate"]),
                     "search_fit": search_fit, "sweep_fit": sweep_fit,
                     "fit_rel_diff": _rel(search_fit["rate"], sweep_fit["rate"])})
    return rows
