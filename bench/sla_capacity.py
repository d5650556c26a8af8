#!/usr/bin/env python3
"""SLA capacity search through the front door: the highest request rate that still meets the SLA, per context.

For each context length of the inventory's range (pd_sla.context_min_tokens .. context_max_tokens), find the
highest request rate at which mean TTFT and mean TPOT still meet pd_sla (ttft_mean_s, tpot_mean_ms): double the
rate until a point misses (bracket), then bisect (geometric midpoints) until the passing and the failing rate
are within --precision of each other. The load is vLLM's own `vllm bench serve` (--prompts: distinct filler-word
prompts by default, bench/capacity_prompts.py; fixed input and output lengths, Poisson arrivals at --request-rate,
--goodput, --save-result), run from the pinned vLLM venv;
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
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from ansible_collections.b300.pd.bench.capacity_admission import ADMISSION_MARGIN, admission_limit, write_patch
from ansible_collections.b300.pd.bench.capacity_bench_serve import run_point, run_warmup
from ansible_collections.b300.pd.bench.capacity_fit import add_fits, compare
from ansible_collections.b300.pd.bench.capacity_plan import (
    Sla,
    UsageError,
    context_lengths,
    load_group_vars,
    plan_from_vars,
)
from ansible_collections.b300.pd.bench.capacity_points import Point, decisive_miss, majority_verdict, rate_verdicts
from ansible_collections.b300.pd.bench.capacity_prompts import PROMPT_KINDS, PromptError, tokens_per_word
from ansible_collections.b300.pd.bench.capacity_report import load_report, plot_report, render_markdown
from ansible_collections.b300.pd.bench.capacity_search import (
    BudgetSpent,
    budget_allows,
    capacity_search,
    knee_of_sweep,
    point_worst_s,
    sweep_centre,
    sweep_rates,
)

ROOT = Path(__file__).resolve().parents[1]
FRONTDOOR_KEY = ROOT / ".cache" / "frontdoor" / "api-key"
# The clock of --budget-s (monotonic: a wall-clock step must not stretch or cut the budget); tests replace it.
clock = time.monotonic


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--inventory", required=True, help="inventory directory (inventory/b300, inventory/local)")
    ap.add_argument("--base-url", required=True, help="front door / router URL, e.g. http://10.237.0.13:8000")
    ap.add_argument("--prometheus-url", default="", help="Prometheus URL; empty: no per-pool figures")
    ap.add_argument("--vllm-python", default=str(ROOT / ".cache" / "vllm-venv" / "bin" / "python"),
                    help="python of a venv with the pinned vLLM (default: the control node's .cache/vllm-venv)")
    ap.add_argument("--tokenizer", required=True, help="model directory (or HF id): the prompts' token counts")
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="words",
                    help="words (default): distinct filler-word prompts, none sharing a prefix, as pd_load and "
                         "pd_overload send; random: vLLM's random dataset (on a small vocabulary its prompts repeat "
                         "and the prefix cache serves part of them: bench/capacity_prompts.py)")
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
    ap.add_argument("--admission-file",
                    help="write the front door's admission limit (pd_frontdoor_max_inflight, requests in flight at "
                         "the highest rate within --admission-margin of the SLA) as a group_vars file here, e.g. "
                         "inventory/local/group_vars/all/admission.yml. "
                         "Measure with the door's admission off (-e pd_frontdoor_max_inflight=0 on the routers' play): "
                         "it would refuse the search's bursts (429, counted as failed requests)")
    ap.add_argument("--front-doors", type=int, default=1,
                    help="front doors taking clients at once; each admits the cluster's figure divided by this")
    ap.add_argument("--admission-margin", type=float, default=ADMISSION_MARGIN,
                    help="the admission limit is taken at the highest rate whose mean TTFT and TPOT are within this "
                         "part of pd_sla (the door holds the engines at the limit under overload; at the knee itself "
                         "they miss the SLA there)")
    a = ap.parse_args(argv)
    vars_ = load_group_vars(Path(a.inventory))
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
    if a.front_doors < 1:
        raise UsageError(f"--front-doors {a.front_doors}: must be >= 1 (front doors taking clients at once)")
    if not 0 < a.admission_margin <= 1:
        raise UsageError(f"--admission-margin {a.admission_margin}: give a part of pd_sla in (0, 1], e.g. 0.8")
    if a.admission_file and a.finer_sweep:
        raise UsageError("--admission-file goes with a search, not --finer-sweep (the search's max rates set it)")
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
        a.tokens_per_word = tokens_per_word(a.vllm_python, a.tokenizer) if a.prompts == "words" else None
        # each context's sweep centre before anything is measured (a context the search lacks stops here); none
        # where --sweep-min and --sweep-max set the range
        centred = a.finer_sweep and baseline and (a.sweep_min is None or a.sweep_max is None)
        centres = {ctx: sweep_centre(baseline, ctx, a.sweep_centre, asdict(a.plan.sla), a.fit_window)
                   for ctx in contexts} if centred else {}
    except (UsageError, PromptError) as exc:
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
           "output_len": plan.output_len, "prompts": a.prompts, "tokens_per_word": a.tokens_per_word,
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

            def measure(rate, ctx=ctx, record=measured.append, contexts_after=contexts_after):
                # --repeats N: most of up to N points decide (it stops once they do). --repeats 1: a rate fails
                # only when each of its 1 + --confirm-failures points fails: what disturbs a point on shared cores
                # (another job, a stall) only slows it down, it never makes an overloaded rate pass.
                passes = fails = 0
                for attempt in range(1, max(a.repeats, a.confirm_failures + 1) + 1):
                    if not budget_allows(clock() - budget_t0, worst, contexts_after, a.budget_s):
                        raise BudgetSpent(f"--budget-s {a.budget_s:g}: no time left for a point at {rate:g} req/s")
                    p = run_point(a, ctx, rate, raw_dir, log, attempt=attempt)
                    record(p)
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
                    max_rate, fail_rate, _points = capacity_search(measure, start_rate, a.precision, a.min_rate,
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
    if not a.finer_sweep:
        rep["admission"] = admission_limit(rep, a.front_doors, a.admission_margin)
        if a.admission_file and not interrupted:
            log(f"admission: pd_frontdoor_max_inflight {rep['admission']['max_inflight']} -> "
                f"{write_patch(a.admission_file, rep['admission'], str(out_dir / 'report.json'))}")
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
