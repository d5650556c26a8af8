"""One measured point of a capacity run (a `vllm bench serve` result at one rate and context length), its SLA
verdict, and the verdict of a rate measured by one or more points (--confirm-failures, --repeats)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ansible_collections.b300.pd.bench.capacity_plan import Sla


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
    # CPU seconds `vllm bench serve` used for the point (its start included): the client's share of shared cores
    client_cpu_s: float | None = None
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
