#!/usr/bin/env python3
"""Steady load through the P/D router during a rolling upgrade or a fault test; counts every request. Stdlib only.

Keeps a stream of greedy completions going to an OpenAI-compatible URL (the router) until --duration elapses,
--max-requests were sent, SIGTERM/SIGINT arrives or --stop-file appears; then waits up to --grace for the
requests in flight and writes a JSON report (--out) plus a short summary. Exit 1 when more than --max-failed
requests failed (or fewer than --min-completed completed), 2 on bad arguments.

  python3 bench/pd_load.py --url http://10.237.0.13:8000 --model tiny-pd --concurrency 4 \
      --max-tokens 16 --prompt-words 64 --stop-file /tmp/pd_load.stop --out reports/pd_load.json

Load shapes: --concurrency N alone = N closed-loop workers (each sends its next request when the previous one
ends); --rate R = requests start on a fixed schedule of R per second (open loop), at most --concurrency (default
64) in flight: a request whose slot comes late is still sent, late, and counted in late_starts.

Every request is new TCP connection (no keep-alive: a restart of the router cannot turn a stale pooled
connection into a client-side failure), carries X-Request-Id pdload-<run>-<n> (grep the router/vLLM logs for
it) and ends in exactly one of: completed, or failed with one class (see FAILURE_CLASSES).

Library use (a pytest integration test around a playbook run):

    from ansible_collections.b300.pd.bench.pd_load_generator import LoadGenerator
    gen = LoadGenerator(url="http://10.237.0.13:8000", model="tiny-pd", concurrency=2)
    gen.start()                 # returns at once; load runs in background threads
    run_a_change_through_site_yml()
    rep = gen.stop()            # stop sending, wait for in-flight (grace), final report dict
    assert rep["failed"] == 0 and rep["completed"] > 0, rep["failures"]

Runs on Python >= 3.9 where the collection b300.pd is importable (the control venv): its settings are
bench/pd_load_config.py, one request bench/pd_load_request.py, the generator and its report
bench/pd_load_generator.py; its prompts are the verify package's (roles/pd_verify/files/pd_verify/prompts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import fields

from ansible_collections.b300.pd.bench.pd_load_config import ConfigError, LoadConfig, client_api_key
from ansible_collections.b300.pd.bench.pd_load_generator import LoadGenerator
from ansible_collections.b300.pd.bench.pd_load_request import FAILURE_CLASSES


def summary(rep: dict) -> str:
    """A few lines for a human (and a CI log)."""
    fails = ", ".join(f"{k} {v}" for k, v in rep["failures"].items()) or "none"
    lines = [f"pd_load {rep['run_id']}: sent {rep['sent']}, completed {rep['completed']}, failed {rep['failed']} "
             f"({fails}); stop: {rep['stop_reason']}, in flight at stop {rep['in_flight_at_stop']}, "
             f"unfinished {rep['unfinished']}"]
    lat = rep["latency_s"]
    if lat:
        thr = rep["throughput"]
        lines.append(f"latency p50 {lat['p50']:.3f} s  p95 {lat['p95']:.3f} s  p99 {lat['p99']:.3f} s  "
                     f"max {lat['max']:.3f} s; {thr['completed_req_s']} req/s, {thr['output_tok_s']} tok/s "
                     f"over {rep['send_duration_s']} s")
    if rep["ttft_s"]:
        t = rep["ttft_s"]
        lines.append(f"ttft p50 {t['p50']:.3f} s  p95 {t['p95']:.3f} s  p99 {t['p99']:.3f} s  max {t['max']:.3f} s")
    gap = rep["longest_completion_gap_s"]
    if gap["from_t_s"] is not None:
        lines.append(f"longest gap between completions: {gap['gap_s']} s from t={gap['from_t_s']} s")
    if rep["late_starts"]:
        lines.append(f"late starts: {rep['late_starts']} (max lag {rep['max_start_lag_s']} s; the concurrency "
                     f"cap was reached)")
    bad = [r for r in rep["timeline"] if r["failed"]]
    if bad:
        lines.append(f"failures from t={rep['first_failure_t_s']} s to t={rep['last_failure_t_s']} s, in "
                     f"{len(bad)} timeline bucket(s) of {rep['config']['bucket']:g} s")
    for cls, samples in rep["error_samples"].items():
        s = samples[0]
        body = f": {s['body'][:160]!r}" if s["body"] else ""
        lines.append(f"  [{cls}] t={s['t_s']} s {s['request_id']}: {s['detail']}{body}")
    verdict = "PASS" if rep["passed"] else "FAIL (" + "; ".join(rep["fail_reasons"] or ["not finished"]) + ")"
    lines.append(verdict)
    return "\n".join(lines)


def progress_line(rep: dict) -> str:
    last = rep["timeline"][-2] if len(rep["timeline"]) >= 2 else None
    fails = " ".join(f"{k}={v}" for k, v in rep["failures"].items())
    lat = rep["latency_s"]
    tail = f" | last {rep['config']['bucket']:g}s: ok {last['completed']} failed {last['failed']}" if last else ""
    p50 = f" p50 {lat['p50']:.3f}s" if lat else ""
    return (f"[{rep['elapsed_s']:8.1f}s] sent {rep['sent']} ok {rep['completed']} failed {rep['failed']}"
            f"{' (' + fails + ')' if fails else ''} in-flight {rep['in_flight']}{p50}{tail}")


def write_json(path: str, rep: dict) -> None:
    """Atomic write (a reader never sees half a report)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit: 0 passed, 1 failed > --max-failed or completed < --min-completed, 2 bad arguments. "
               "Failure classes: " + "; ".join(f"{k}: {v}" for k, v in FAILURE_CLASSES.items()))
    d = LoadConfig()
    ap.add_argument("--url", required=True, help="OpenAI-compatible base URL (the router), e.g. "
                    "http://10.237.0.13:8000")
    ap.add_argument("--model", required=True, help="served model name (pd_served_model_name)")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default=d.endpoint,
                    help="/v1/completions (default) or /v1/chat/completions")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request (default 16)")
    ap.add_argument("--prompt-words", type=int, default=d.prompt_words,
                    help="prompt length in words, ~1-1.3 tokens each (default 64)")
    ap.add_argument("--concurrency", type=int, help="closed-loop workers (default 4); with --rate: the cap on "
                    "requests in flight (default 64)")
    ap.add_argument("--rate", type=float, help="open loop: start R requests per second on a fixed schedule")
    ap.add_argument("--duration", type=float, help="seconds to send for; 0 or absent: until SIGTERM/SIGINT, "
                    "--stop-file or --max-requests")
    ap.add_argument("--max-requests", type=int, help="stop after sending this many requests")
    ap.add_argument("--stop-file", help="stop when this path appears (it must not exist at start)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per-request deadline, connect to last "
                    "byte (default 60 s)")
    ap.add_argument("--grace", type=float, help="after the stop, wait this long for in-flight requests "
                    "(default timeout + 5 s); those still running then count as failed 'unfinished'")
    ap.add_argument("--stream", action="store_true", help="stream (SSE) and record TTFT")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="do not send ignore_eos/min_tokens (vLLM extensions); then min output is 1 token")
    ap.add_argument("--min-output-tokens", type=int, help="fewer completion tokens = failed short_output "
                    "(default: max-tokens, or 1 with --no-ignore-eos)")
    ap.add_argument("--api-key", default=client_api_key(),
                    help="Bearer token (default: $PD_LOAD_API_KEY, else the file $PD_API_KEY_FILE, else the local "
                    "stack's .cache/frontdoor/api-key; the env var or file keeps it out of ps)")
    ap.add_argument("--seed", type=int, default=d.seed, help="prompt seed (request n uses seed*1000003+n)")
    ap.add_argument("--error-samples", type=int, default=d.error_samples, help="failed requests kept per "
                    "failure class, with their body excerpt (default 3)")
    ap.add_argument("--max-failed", type=int, default=d.max_failed, help="exit 1 when failed > this (default 0)")
    ap.add_argument("--min-completed", type=int, default=d.min_completed,
                    help="exit 1 when completed < this (default 1: a run that completed nothing never passes)")
    ap.add_argument("--bucket", type=float, default=d.bucket, help="timeline bucket width in seconds "
                    "(default 1; e.g. 10 for an hour-long soak)")
    ap.add_argument("--out", help="write the JSON report here (rewritten with running: true at every progress "
                    "line, final at the end)")
    ap.add_argument("--progress", type=float, default=10.0, help="progress line on stderr every S seconds "
                    "(0: none; default 10)")
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the summary")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    names = {f.name for f in fields(LoadConfig)}
    try:
        gen = LoadGenerator(LoadConfig(**{k: v for k, v in vars(a).items() if k in names}))
    except ConfigError as e:
        print(f"pd_load: bad arguments: {e}", file=sys.stderr)
        return 2

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        if gen.stopping:
            gen.request_stop(grace=0)
            print(f"pd_load: {name} again: abandoning the requests in flight (counted as unfinished)",
                  file=sys.stderr, flush=True)
        else:
            gen.request_stop(reason=f"signal:{name}")
            print(f"pd_load: {name}: stopping; waiting up to {gen.cfg.grace_s:g} s for the requests in flight "
                  f"({name} again to abandon them)", file=sys.stderr, flush=True)

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, on_signal)
    try:
        gen.start()
        next_progress = time.monotonic() + a.progress if a.progress > 0 else None
        while not gen.wait(0.1):
            if next_progress is not None and time.monotonic() >= next_progress:
                next_progress += a.progress
                rep = gen.report()
                print(progress_line(rep), file=sys.stderr, flush=True)
                if a.out:
                    write_json(a.out, rep)
        rep = gen.report()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if a.out:
        write_json(a.out, rep)
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print(summary(rep) + (f"\nreport: {a.out}" if a.out else ""), flush=True)
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
