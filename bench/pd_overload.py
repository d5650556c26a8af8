#!/usr/bin/env python3
"""Overload through the front door: two client keys, open loop far above capacity; the front door must shed the
excess at once (429 + Retry-After) while the admitted requests keep the SLA and the light key keeps its share.

    .venv/bin/python bench/pd_overload.py -i inventory/local --capacity-report reports/capacity/<run>/report.json
    .venv/bin/python bench/pd_overload.py -i inventory/local --max-rate 4 [--load-factors heavy=2.7,light=0.3]
        [--duration 60] [--prompt-words 600] [--max-tokens 32] [--out reports/overload/overload-latest.json]

The max rate R is the SLA capacity search's (bench/sla_capacity.py): --max-rate, or the context length of its
report closest to --prompt-tokens. Key 1 (client_api_key(1)) sends heavy x R req/s, key 2 (client_api_key(2))
light x R, both streamed (TTFT and TPOT measured) for --duration s, with an in-flight cap the client never reaches.
The criteria (issue #31): admitted requests meet pd_sla (mean TTFT, mean TPOT) and none fails otherwise; the light
key gets >= 95 % admitted; every 429 carries Retry-After and arrives within 100 ms at p99; no 5xx; goodput (completed
req/s over the send duration, both keys) >= 0.8 x R. --prompt-words 600 gives ~3000 prompt tokens on the local
tiny model (its tokenizer: 5.0 tokens per word_prompt word, 2897-3105 tokens over 200 seeds); the report has the
measured usage.prompt_tokens. Front door URL, model and pd_sla come from the inventory. Exit 0 when every criterion
passes, 1 when one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from ansible_collections.b300.pd.bench.pd_load_config import ConfigError, client_api_key
from ansible_collections.b300.pd.bench.pd_load_generator import LoadGenerator

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "pd_overload/1"
DEFAULT_PROMPT_WORDS = 600  # ~3000 tokens on tiny-pd (5.0 tokens per word)
KEYS = ("heavy", "light")  # key 1, key 2
LIGHT_ADMITTED_MIN = 0.95
SHED_P99_MAX_S = 0.1
GOODPUT_MIN_FACTOR = 0.8


class UsageError(ValueError):
    """Bad input: the message names the option and the fix."""


def parse_factors(text) -> dict:
    """'heavy=2.7,light=0.3' (or a dict) -> {'heavy': 2.7, 'light': 0.3}."""
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in str(text).split(","):
            name, sep, val = part.partition("=")
            if not sep:
                raise UsageError(f"--load-factors {text!r}: write NAME=FACTOR pairs, e.g. heavy=2.7,light=0.3")
            items.append((name.strip(), val.strip()))
    out = {}
    for name, val in items:
        try:
            out[name] = float(val)
        except (TypeError, ValueError):
            raise UsageError(f"--load-factors: {name}={val!r} is not a number; e.g. heavy=2.7,light=0.3") from None
    if sorted(out) != sorted(KEYS) or not all(v > 0 and math.isfinite(v) for v in out.values()):
        raise UsageError(f"--load-factors {text!r}: give heavy=F,light=F (key 1, key 2), each factor > 0")
    return {k: out[k] for k in KEYS}


def max_rate_from_report(path: str, prompt_tokens: float) -> tuple[float, int]:
    """(max_rate, context) of the sla_capacity report's context length closest to prompt_tokens."""
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--capacity-report {path}: not a readable report.json ({exc}); give "
                         "reports/capacity/<run>/report.json of bench/sla_capacity.py") from None
    ctxs = [c for c in rep.get("contexts") or [] if isinstance(c, dict) and c.get("context") is not None
            and (c.get("max_rate") or 0) > 0] if isinstance(rep, dict) else []
    if not ctxs:
        raise UsageError(f"--capacity-report {path}: no context length with a max_rate > 0; rerun the capacity "
                         "search or give --max-rate")
    best = min(ctxs, key=lambda c: (abs(c["context"] - prompt_tokens), c["context"]))
    return float(best["max_rate"]), int(best["context"])


def inventory_targets(inventory: str) -> dict:
    """{url, model, sla} of an inventory: the front door (the cluster view's router_url), the served model, pd_sla."""
    from ansible_collections.b300.pd.bench.pd_cluster import inventory_data, view_from

    groups, hv = inventory_data(inventory)
    view = view_from(groups, hv)
    router = view["routers"][0]["host"]
    sla = next((hv[h]["pd_sla"] for h in [*groups["vllm_hosts"], router] if hv.get(h, {}).get("pd_sla")), None)
    if not sla or not all(isinstance(sla.get(k), (int, float)) for k in ("ttft_mean_s", "tpot_mean_ms")):
        raise UsageError(f"-i {inventory}: pd_sla with ttft_mean_s and tpot_mean_ms is missing; set it in "
                         "group_vars/all/sla.yml (see inventory/local)")
    return {"url": view["router_url"], "model": hv[router]["pd_served_model_name"], "sla": sla}


def run_loads(url, model, api_keys, rates, *, duration, prompt_words, max_tokens, timeout) -> dict:
    """One streamed open loop per key at once -> {key name: pd_load report}."""
    gens = {}
    for seed, name in enumerate(rates, start=1):
        rate = rates[name]
        # in-flight cap: what the rate can have in flight within the timeout (the client never limits)
        cap = max(1, min(math.ceil(rate * (timeout + 1)), math.ceil(rate * duration)))
        gens[name] = LoadGenerator(url=url, model=model, api_key=api_keys[name], rate=rate, concurrency=cap,
                                   duration=duration, stream=True, max_tokens=max_tokens, prompt_words=prompt_words,
                                   timeout=timeout, seed=seed, max_failed=10**9, min_completed=0, error_samples=3)
    for gen in gens.values():
        gen.start()
    while not all(g.wait(0.2) for g in gens.values()):
        pass
    return {name: g.report() for name, g in gens.items()}


def _pooled_mean(stats_list) -> tuple[float | None, int]:
    n = sum(s["count"] for s in stats_list if s)
    if not n:
        return None, 0
    return sum(s["mean"] * s["count"] for s in stats_list if s) / n, n


def key_summary(rep: dict) -> dict:
    fails = rep.get("failures") or {}
    shed = fails.get("http_429", 0)
    sent = rep["sent"]
    five = sum(v for k, v in fails.items() if k.startswith("http_5"))
    shed_lat = (rep.get("failure_latency_s") or {}).get("http_429")
    return {"rate": rep["config"]["rate"], "sent": sent, "completed": rep["completed"], "shed": shed,
            "admitted_fraction": round(1 - shed / sent, 4) if sent else None, "http_5xx": five,
            "other_failures": {k: v for k, v in fails.items() if k != "http_429" and not k.startswith("http_5")},
            "shed_latency_p50_s": shed_lat["p50"] if shed_lat else None,
            "shed_latency_p99_s": shed_lat["p99"] if shed_lat else None,
            "shed_without_retry_after": rep.get("retry_after_missing", 0),
            "ttft_s": rep.get("ttft_s"), "tpot_s": rep.get("tpot_s"), "prompt_tokens": rep.get("prompt_tokens"),
            "send_duration_s": rep["send_duration_s"], "error_samples": rep.get("error_samples") or {}}


def evaluate(reports: dict, max_rate: float, sla: dict) -> dict:
    """The criteria of issue #31's overload test over the per-key pd_load reports ({'heavy': rep, 'light': rep})."""
    keys = {name: key_summary(rep) for name, rep in reports.items()}
    ttft, n_ttft = _pooled_mean([reports[k].get("ttft_s") for k in reports])
    tpot, n_tpot = _pooled_mean([reports[k].get("tpot_s") for k in reports])
    sent = sum(k["sent"] for k in keys.values())
    completed = sum(k["completed"] for k in keys.values())
    shed = sum(k["shed"] for k in keys.values())
    five = sum(k["http_5xx"] for k in keys.values())
    other = {}
    for k in keys.values():
        for cls, n in k["other_failures"].items():
            other[cls] = other.get(cls, 0) + n
    p99s = [k["shed_latency_p99_s"] for k in keys.values() if k["shed_latency_p99_s"] is not None]
    shed_p99 = max(p99s) if p99s else None  # the union's p99 is at most the larger per-key p99
    no_ra = sum(k["shed_without_retry_after"] for k in keys.values())
    send_s = max((k["send_duration_s"] for k in keys.values()), default=0.0)
    goodput = completed / send_s if send_s > 0 else 0.0
    light = keys.get("light") or {}
    light_adm = light.get("admitted_fraction")
    sla_ttft, sla_tpot = float(sla["ttft_mean_s"]), float(sla["tpot_mean_ms"])
    tpot_ms = None if tpot is None else tpot * 1000

    def crit(name, ok, figure, want):
        return {"name": name, "passed": bool(ok), "figure": figure, "want": want}

    criteria = [
        crit("sent", all(k["sent"] > 0 for k in keys.values()) and len(keys) == len(KEYS),
             {n: k["sent"] for n, k in keys.items()}, "both keys sent requests"),
        crit("admitted_ttft_mean", ttft is not None and ttft <= sla_ttft,
             None if ttft is None else round(ttft, 4), f"<= {sla_ttft:g} s (pd_sla.ttft_mean_s)"),
        crit("admitted_tpot_mean", tpot_ms is not None and tpot_ms <= sla_tpot,
             None if tpot_ms is None else round(tpot_ms, 3), f"<= {sla_tpot:g} ms (pd_sla.tpot_mean_ms)"),
        crit("admitted_failures", not other, other, "no admitted request fails (timeout, reset, bad body, ...)"),
        crit("light_admitted", light_adm is not None and light_adm >= LIGHT_ADMITTED_MIN, light_adm,
             f">= {LIGHT_ADMITTED_MIN:g} of the light key's requests admitted"),
        crit("shed_retry_after", no_ra == 0, no_ra, "0 responses 429 without Retry-After"),
        crit("shed_latency_p99", shed_p99 is None or shed_p99 <= SHED_P99_MAX_S, shed_p99,
             f"429 answered in <= {SHED_P99_MAX_S * 1000:g} ms at p99"),
        crit("no_5xx", five == 0, five, "0 responses 5xx"),
        crit("goodput", goodput >= GOODPUT_MIN_FACTOR * max_rate, round(goodput, 4),
             f">= {GOODPUT_MIN_FACTOR:g} x max rate {max_rate:g} = {GOODPUT_MIN_FACTOR * max_rate:.4g} req/s"),
    ]
    return {"schema": SCHEMA, "max_rate": max_rate, "sla": {"ttft_mean_s": sla_ttft, "tpot_mean_ms": sla_tpot},
            "keys": keys,
            "overall": {"sent": sent, "completed": completed, "shed": shed,
                        "admitted_fraction": round(1 - shed / sent, 4) if sent else None, "http_5xx": five,
                        "other_failures": other, "shed_latency_p99_s": shed_p99, "shed_without_retry_after": no_ra,
                        "admitted_ttft_mean_s": None if ttft is None else round(ttft, 4), "ttft_count": n_ttft,
                        "admitted_tpot_mean_ms": None if tpot_ms is None else round(tpot_ms, 3),
                        "tpot_count": n_tpot, "send_duration_s": send_s, "goodput_req_s": round(goodput, 4)},
            "criteria": criteria, "passed": all(c["passed"] for c in criteria)}


def run_overload(inventory, max_rate, factors="heavy=2.7,light=0.3", duration=60.0,  # noqa: PLR0917 - the CI API
                 prompt_words=DEFAULT_PROMPT_WORDS, max_tokens=32, timeout=60.0, *, url=None, model=None, sla=None,
                 api_keys=None) -> dict:
    """The overload run -> its report (with `passed` and `criteria`). url/model/sla/api_keys override what the
    inventory and client_api_key(1|2) give (inventory may then be None). Raises UsageError on bad input."""
    factors = parse_factors(factors)
    if not (isinstance(max_rate, (int, float)) and max_rate > 0):
        raise UsageError(f"--max-rate {max_rate!r}: must be > 0 req/s (the capacity search's max rate)")
    if duration <= 0:
        raise UsageError(f"--duration {duration!r}: must be > 0 seconds")
    if url is None or model is None or sla is None:
        if not inventory:
            raise UsageError("-i/--inventory: needed for the front door URL, model and pd_sla")
        tgt = inventory_targets(inventory)
        url, model, sla = url or tgt["url"], model or tgt["model"], sla or tgt["sla"]
    if api_keys is None:
        api_keys = {"heavy": client_api_key(1), "light": client_api_key(2)}
    if not api_keys.get("heavy") or not api_keys.get("light"):
        raise UsageError("client keys: key 1 ($PD_LOAD_API_KEY, .cache/frontdoor/api-key) and key 2 "
                         "($PD_LOAD_API_KEY_2, .cache/frontdoor/api-key-2) are both needed; make key 2 with "
                         "scripts/bootstrap.d/60-frontdoor-key")
    if api_keys["heavy"] == api_keys["light"]:
        raise UsageError("client keys: key 1 and key 2 are the same key; the per-key share cannot be tested")
    rates = {k: round(f * max_rate, 6) for k, f in factors.items()}
    t0, cpu0, wall0 = time.time(), _cpu_s(), time.monotonic()
    try:
        reports = run_loads(url, model, api_keys, rates, duration=duration, prompt_words=prompt_words,
                            max_tokens=max_tokens, timeout=timeout)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    cpu, wall = _cpu_s() - cpu0, time.monotonic() - wall0
    rep = evaluate(reports, max_rate, sla)
    rep.update(started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), url=url, model=model,
               factors=factors, rates=rates, duration_s=duration, prompt_words=prompt_words, max_tokens=max_tokens,
               timeout_s=timeout,
               # The load generator's own CPU (this process, all its threads) over the run: where it shares cores
               # with the engines (the embedded default), what it takes is not there for serving.
               client_cpu={"cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                           "cores": round(cpu / wall, 3) if wall > 0 else None})
    return rep


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def summary(rep: dict) -> str:
    o = rep["overall"]
    lines = [f"overload at {sum(rep['rates'].values()):g} req/s ({rep['rates']}) vs max rate {rep['max_rate']:g}, "
             f"{rep['duration_s']:g} s, {rep['prompt_words']} words"]
    for name, k in rep["keys"].items():
        pt = k["prompt_tokens"]
        lines.append(f"  {name}: sent {k['sent']} completed {k['completed']} shed {k['shed']} admitted "
                     f"{k['admitted_fraction']} 5xx {k['http_5xx']} other {k['other_failures'] or 0} 429 p50/p99 "
                     f"{k['shed_latency_p50_s']}/{k['shed_latency_p99_s']} s"
                     + (f" prompt tokens mean {pt['mean']:.0f}" if pt else ""))
    lines.append(f"  overall: goodput {o['goodput_req_s']} req/s, admitted TTFT mean {o['admitted_ttft_mean_s']} s, "
                 f"TPOT mean {o['admitted_tpot_mean_ms']} ms")
    if rep.get("client_cpu"):
        lines.append(f"  load generator CPU: {rep['client_cpu']['cores']} cores ({rep['client_cpu']['cpu_s']} s)")
    for c in rep["criteria"]:
        lines.append(f"  {'PASS' if c['passed'] else 'FAIL'} {c['name']}: {c['figure']} (want {c['want']})")
    lines.append("PASS" if rep["passed"] else "FAIL")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--inventory", default="inventory/local")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--max-rate", type=float, help="the capacity search's max rate, req/s")
    src.add_argument("--capacity-report", help="a bench/sla_capacity.py report.json (context closest to "
                     "--prompt-tokens)")
    ap.add_argument("--prompt-tokens", type=float, default=3000, help="the context to pick from --capacity-report")
    ap.add_argument("--load-factors", default="heavy=2.7,light=0.3")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--prompt-words", type=int, default=DEFAULT_PROMPT_WORDS)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    ap.add_argument("--out", default="reports/overload/overload-latest.json")
    a = ap.parse_args(argv)
    try:
        context = None
        if a.capacity_report:
            max_rate, context = max_rate_from_report(a.capacity_report, a.prompt_tokens)
        elif a.max_rate is not None:
            max_rate = a.max_rate
        else:
            raise UsageError("--max-rate or --capacity-report: give one (the capacity search's max rate)")
        rep = run_overload(a.inventory, max_rate, a.load_factors, a.duration, a.prompt_words, a.max_tokens,
                           a.timeout)
    except UsageError as exc:
        print(f"pd_overload: {exc}", file=sys.stderr)
        return 2
    rep["capacity_context"] = context
    print(summary(rep))
    pts = [k["prompt_tokens"]["mean"] for k in rep["keys"].values() if k["prompt_tokens"]]
    if pts and abs(sum(pts) / len(pts) / a.prompt_tokens - 1) > 0.2:
        print(f"note: mean prompt tokens {sum(pts) / len(pts):.0f} is far from --prompt-tokens {a.prompt_tokens:g}; "
              "adjust --prompt-words", file=sys.stderr)
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print(f"report: {out}")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
