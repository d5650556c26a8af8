"""pd_verify's sla step: a closed-loop streaming benchmark through the router, judged against the SLA."""

from __future__ import annotations

import math
import statistics
import threading
import time

from .client import HttpError, stream_completion


def percentile(values, p):
    """Nearest-rank percentile (the smallest value with at least p % of the values <= it); None if empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100.0 * len(s)) - 1))]


def summarize_bench(records, duration_s, ttft_slo_ms, tpot_slo_ms):
    """vllm bench serve's definitions: TTFT; TPOT = (e2e - ttft) / (output_tokens - 1); goodput = req/s meeting both."""
    ok = [r for r in records if "error" not in r]
    ttfts = [r["ttft_s"] * 1000 for r in ok]
    tpots = [(r["e2e_s"] - r["ttft_s"]) * 1000 / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    good = [r for r in ok if r["ttft_s"] * 1000 <= ttft_slo_ms and
            (r["output_tokens"] <= 1 or (r["e2e_s"] - r["ttft_s"]) * 1000 / (r["output_tokens"] - 1) <= tpot_slo_ms)]

    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": round(duration_s, 3),
        "mean_ttft_ms": round(statistics.fmean(ttfts), 3) if ttfts else None,
        "median_ttft_ms": round(statistics.median(ttfts), 3) if ttfts else None,
        "p99_ttft_ms": round(percentile(ttfts, 99), 3) if ttfts else None,
        "mean_tpot_ms": round(statistics.fmean(tpots), 3) if tpots else None,
        "median_tpot_ms": round(statistics.median(tpots), 3) if tpots else None,
        "p99_tpot_ms": round(percentile(tpots, 99), 3) if tpots else None,
        "output_throughput_tok_s": round(out_tokens / duration_s, 3) if duration_s > 0 else None,
        "request_throughput_req_s": round(len(ok) / duration_s, 4) if duration_s > 0 else None,
        "goodput_req_s": round(len(good) / duration_s, 4) if duration_s > 0 else None,
        "good_requests": len(good),
    }


def run_bench(url, model, prompts_list, output_len, concurrency, *, api_key=None, timeout=600.0):
    """Closed-loop benchmark: ``concurrency`` workers through the list; returns (records, duration_s)."""
    records = [None] * len(prompts_list)
    lock = threading.Lock()
    nxt = [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts_list):
                return
            payload = {"model": model, "prompt": prompts_list[i], "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "min_tokens": output_len}
            try:
                records[i] = stream_completion(url + "/v1/completions", payload, timeout=timeout, api_key=api_key)
                records[i].pop("text", None)
            except HttpError as e:
                records[i] = {"error": str(e)}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _worker in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def step_sla(cfg, prompts):
    s = cfg["sla"]
    n = int(s["num_prompts"])
    plist = [prompts.make(int(s["input_len"]), 5000 + i)[0] for i in range(n)]
    records, dur = run_bench(cfg["router_url"], cfg["model"], plist, int(s["output_len"]), int(s["concurrency"]),
                             api_key=cfg.get("api_key"), timeout=cfg.get("request_timeout_s", 600))
    ttft_slo_ms, tpot_slo_ms = float(s["ttft_mean_s"]) * 1000, float(s["tpot_mean_ms"])
    summ = summarize_bench(records, dur, ttft_slo_ms, tpot_slo_ms)
    verdicts = {
        "ttft": None if summ["mean_ttft_ms"] is None else summ["mean_ttft_ms"] <= ttft_slo_ms,
        "tpot": None if summ["mean_tpot_ms"] is None else summ["mean_tpot_ms"] <= tpot_slo_ms,
    }
    met = verdicts["ttft"] is True and verdicts["tpot"] is True and summ["failed"] == 0
    errors = [r["error"] for r in records if "error" in r][:5]
    misses = []
    if verdicts["ttft"] is not True:
        misses.append(f"mean TTFT {summ['mean_ttft_ms']} ms > SLA {ttft_slo_ms:.0f} ms")
    if verdicts["tpot"] is not True:
        misses.append(f"mean TPOT {summ['mean_tpot_ms']} ms > SLA {tpot_slo_ms} ms")
    if summ["failed"]:
        misses.append(f"{summ['failed']} request(s) failed: {errors}")
    enforce = bool(s.get("enforce", True))
    return {"ok": met or not enforce, "verdict": "MET" if met else "MISS", "enforced": enforce,
            "goodput_arg": f"ttft:{ttft_slo_ms:.0f} tpot:{tpot_slo_ms:g}",
            "params": {"input_len": int(s["input_len"]), "output_len": int(s["output_len"]),
                       "concurrency": int(s["concurrency"]), "num_prompts": n, "dataset": "random"},
            "sla": {"ttft_mean_ms": ttft_slo_ms, "tpot_mean_ms": tpot_slo_ms}, "result": summ,
            "errors": misses if (enforce and not met) else [], "misses": misses}
