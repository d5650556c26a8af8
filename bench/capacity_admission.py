"""The front door's admission limit from a capacity report: requests in flight where each context length still
meets the SLA with a margin.

Little's law: at a rate that met the SLA, the requests in flight are rate x mean latency, where the latency of a
request is its mean TTFT plus (output tokens - 1) x its mean TPOT, as `vllm bench serve` measured them at that rate.
The rate taken is the highest whose mean TTFT and mean TPOT are both within ADMISSION_MARGIN of pd_sla, not the
knee itself: under overload the door holds the engines at the limit all the time, without the lulls of the search's
Poisson arrivals, and a limit taken at the knee misses the SLA there (measured 2026-12-07 on the embedded default, 60
s at 3x the capacity: the knee's 17 in flight gave a mean TPOT of 21.0-23.5 ms against 20 at M 13-17 and the same
goodput; the margin's 10 gave 15.7 ms and 0.81x the max rate, docs/faults.md). The front door admits at most the
fewest of these over the measured context lengths (the longest context usually: it has the least capacity), so that
whatever the mix of context lengths within pd_sla's range, what is admitted is served within the SLA. The limit is
written as inventory data (pd_frontdoor_max_inflight, with pd_frontdoor_max_rate: the max rate of the context that
set it, of which a client key's share is a part), never parsed back from the front door's config.
"""

from __future__ import annotations

import math
from pathlib import Path

# The part of pd_sla's mean TTFT and mean TPOT a point must be within for its requests in flight to be the limit.
ADMISSION_MARGIN = 0.8


def inflight_within_sla(context: dict, output_len: int, sla: dict, margin: float = ADMISSION_MARGIN) -> float | None:
    """Mean requests in flight over the passing points at the highest rate whose mean TTFT and mean TPOT are within
    margin x sla ({ttft_mean_ms, tpot_mean_ms}; margin 1: the knee); None without such a point."""
    pts = [p for p in context.get("points", []) if p.get("passed") and p.get("request_throughput")
           and p.get("mean_ttft_ms") is not None and p.get("mean_tpot_ms") is not None
           and p["mean_ttft_ms"] <= margin * float(sla["ttft_mean_ms"])
           and p["mean_tpot_ms"] <= margin * float(sla["tpot_mean_ms"])]
    rate = max((p.get("rate") or 0 for p in pts), default=0)
    pts = [p for p in pts if rate and p.get("rate") == rate]
    if not pts:
        return None
    values = [p["request_throughput"] * (p["mean_ttft_ms"] + max(0, output_len - 1) * p["mean_tpot_ms"]) / 1000.0
              for p in pts]
    return sum(values) / len(values)


def admission_limit(report: dict, front_doors: int = 1, margin: float = ADMISSION_MARGIN) -> dict:
    """{"max_inflight": N (0 when nothing met the SLA within the margin), "by_context": {ctx: in flight}, "used":
    [ctx], "front_doors", "margin", "rule"}. A context whose search never saw a failing rate (no bracket: its max rate
    is only a lower bound, e.g. a short context on a small search) is left out while another context has a
    bracket. The report's sla (ttft_mean_ms, tpot_mean_ms) sets the margin's bounds."""
    if front_doors < 1:
        raise ValueError(f"front_doors {front_doors}: need at least 1 front door taking clients")
    if not 0 < margin <= 1:
        raise ValueError(f"margin {margin}: give the part of pd_sla a point must be within, in (0, 1]")
    sla = report.get("sla") or {}
    if "ttft_mean_ms" not in sla or "tpot_mean_ms" not in sla:
        raise ValueError("the capacity report has no sla {ttft_mean_ms, tpot_mean_ms}: rerun bench/sla_capacity.py")
    by_ctx, bracketed = {}, []
    for c in report.get("contexts", []):
        v = inflight_within_sla(c, int(report.get("output_len") or 1), sla, margin)
        if v is not None:
            by_ctx[int(c["context"])] = round(v, 2)
            if c.get("fail_rate") is not None:
                bracketed.append(int(c["context"]))
    used = bracketed or sorted(by_ctx)
    cluster = min(by_ctx[c] for c in used) if used else 0.0
    # The rate a key's share is a part of: the max rate of the context that set the limit.
    binding = min(used, key=lambda c: by_ctx[c]) if used else None
    rate = next((float(c["max_rate"]) for c in report.get("contexts", []) if int(c["context"]) == binding), 0.0)
    per_door = max(1, math.floor(cluster / front_doors)) if cluster >= 1 else 0
    return {"max_inflight": per_door, "cluster_inflight": round(cluster, 2), "by_context": by_ctx,
            "used": sorted(used), "front_doors": front_doors, "margin": margin,
            "max_rate": round(rate / front_doors, 3) if per_door else 0, "binding_context": binding,
            "rule": "fewest requests in flight (rate x (mean TTFT + (output-1) x mean TPOT) at the highest rate whose "
                    f"mean TTFT and TPOT are within {margin:g} x pd_sla) over the contexts whose search bracketed the "
                    "knee, divided by the front doors taking clients, rounded down"}


def inventory_patch(limit: dict, report_path: str) -> str:
    """A group_vars file setting pd_frontdoor_max_inflight, saying where the figure comes from."""
    ctx = ", ".join(f"{k} tokens: {v:g}" + ("" if k in limit.get("used", [k]) else " (no bracket, left out)")
                    for k, v in sorted(limit["by_context"].items())) or "none met the SLA"
    return ("---\n"
            "# Written by bench/sla_capacity.py --admission-file: the front door's admission limit\n"
            f"# (roles/pd_frontdoor) from {report_path}.\n"
            f"# Requests in flight where each context meets {limit.get('margin', ADMISSION_MARGIN):g} x pd_sla:\n"
            f"# {ctx}; the fewest, over {limit['front_doors']} front door(s).\n"
            "# Re-measure after a change of hardware, model or flags.\n"
            f"# The max rate at the binding context ({limit.get('binding_context')} tokens), per front door:\n"
            "# the rate a key's share (pd_frontdoor_key_share) is a part of.\n"
            f"pd_frontdoor_max_inflight: {limit['max_inflight']}\n"
            f"pd_frontdoor_max_rate: {limit.get('max_rate', 0)}\n")


def write_patch(path: str, limit: dict, report_path: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(inventory_patch(limit, report_path))
    return out
