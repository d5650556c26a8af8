"""Per-pool figures of one capacity point read back from Prometheus over the point's own window: TTFT, TPOT,
MTP acceptance, KV-transfer (NIXL) time and failures, prefix cache hits."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request

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
