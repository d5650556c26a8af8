#!/usr/bin/env python3
"""What P/D adds to a request, side by side with colocated serving, and what idle engines cost. One run, one table.

For each prompt length, requests alternate between three paths, each with a prompt of its own (same generator,
same length, a unique first word so no path gets another's prefix-cache hit):

  colocated   the whole request straight to one decode instance (it computes the prompt itself)
  pd          the same kind of request through the router (prefill instance -> KV over NIXL -> decode instance)
  split       the router's two calls made by hand, timed apart: the prefill call (max_tokens 1,
              do_remote_decode) and the decode call carrying its kv_transfer_params; says where P/D time goes

Latency is the end-to-end time of a non-streaming greedy completion (--max-tokens). The table gives p50/p99 per
path and what pd adds to colocated (p50 and p99 of the paired differences are not meaningful across independent
requests; the added figures are pd's percentile minus colocated's).

Before the requests, idle CPU: every vLLM unit's (and the router's) CPUUsageNSec from systemd, read twice
--idle-window seconds apart while nothing is sent, as % of one core.

With --restart INSTANCE: restart that instance's unit with the rest of the stack up and report seconds until
its /health answers 200 and until a request through the router succeeds again.

    .venv/bin/python bench/pd_latency.py -i inventory/local [--lengths 256,1024,3000] [--repeats 12]
        [--max-tokens 8] [--idle-window 30] [--restart decode-0] [--out reports/bench/pd-latency.json]

Addresses, ports, units and the model name come from the inventory (bench/pd_faults.py's Stack).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from ansible_collections.b300.pd.bench.pd_faults import Stack, wait_until  # noqa: E402
from ansible_collections.b300.pd.bench.pd_load_config import client_api_key  # noqa: E402
from ansible_collections.b300.pd.bench.pd_load_generator import latency_stats  # noqa: E402
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify import percentile, word_prompt  # noqa: E402

SCHEMA = "pd_latency/1"
PATHS = ("colocated", "pd", "split_prefill", "split_decode")


def worker_api_key() -> str | None:
    """The workers' key every vLLM instance requires on /v1 (pd_router_api_key), never from argv: $PD_WORKER_KEY_FILE,
    else the local stack's (.cache/worker/api-key, scripts/bootstrap.d/65-worker-key); None when neither exists."""
    path = os.environ.get("PD_WORKER_KEY_FILE") or str(ROOT / ".cache/worker/api-key")
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


def post(url: str, body: dict, timeout: float, *, direct: bool = False) -> tuple[float, dict]:
    """POST JSON, return (seconds, parsed answer); raises on HTTP errors (the caller counts them).

    direct: url is a vLLM instance's, which requires the workers' key; else the front door's client key."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    key = worker_api_key() if direct else client_api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - URLs from the inventory
        out = json.load(resp)
    return time.perf_counter() - t0, out


def instance_url(stack: Stack, inst: dict) -> str:
    return inst["url"]  # the cluster view's (Stack.instances)


def calibrated_prompt(stack: Stack, tokenize_url: str, tokens: int, seed: int) -> str:
    """A prompt of about `tokens` tokens (the instance's own tokenizer), starting with a word unique to seed."""
    words = max(1, int(tokens / 1.3))
    for _attempt in range(6):
        text = f"w{seed} " + word_prompt(words, seed)
        _secs, out = post(tokenize_url, {"model": stack.model, "prompt": text}, 60, direct=True)
        got = int(out["count"])
        if abs(got - tokens) <= max(4, tokens // 50):
            return text
        words = max(1, int(words * tokens / max(1, got)))
    return text


# CPU seconds of every process in a unit's cgroup (utime + stime + reaped children, /proc/<pid>/stat), summed:
# works with cgroup v1 hosts without per-unit CPU accounting (the nspawn test hosts), unlike CPUUsageNSec.
_UNIT_CPU = (
    "import os,sys\n"
    "tck=os.sysconf('SC_CLK_TCK')\n"
    "for u in sys.argv[1:]:\n"
    "  t=0\n"
    "  for base in ('/sys/fs/cgroup/unified','/sys/fs/cgroup/systemd','/sys/fs/cgroup'):\n"
    "    f=base+'/system.slice/'+u+'/cgroup.procs'\n"
    "    if os.path.exists(f): break\n"
    "  for pid in open(f).read().split():\n"
    "    try: st=open('/proc/'+pid+'/stat').read().rsplit(')',1)[1].split()\n"
    "    except OSError: continue\n"
    "    t+=sum(int(x) for x in st[11:15])\n"
    "  print(u, t/tck)\n"
)


def idle_cpu(stack: Stack, window: float) -> dict:
    """% of one core per unit over `window` seconds of no traffic (CPU time of the unit's processes)."""
    units = {(i["host"], f"vllm-{i['name']}.service"): i["name"] for i in stack.instances}
    unit = stack.router_unit["name"]
    units[(stack.router_host, unit if unit.endswith(".service") else f"{unit}.service")] = "router"
    script = shlex.quote(_UNIT_CPU)

    def sample() -> tuple[dict, float]:
        got = {}
        for host in sorted({h for h, _unit in units}):
            names = [u for h, u in units if h == host]
            out = stack.run(host, f"python3 -c {script} " + " ".join(names))
            for line in out.replace("\\n", "\n").splitlines():
                unit, _sep, secs = line.strip().partition(" ")
                if (host, unit) in units:
                    got[(host, unit)] = float(secs)
        return got, time.monotonic()

    first, t0 = sample()
    time.sleep(window)
    second, t1 = sample()
    return {units[k]: round(100.0 * (second[k] - first[k]) / (t1 - t0), 1)
            for k in units if k in first and k in second}


def one_round(stack: Stack, urls: dict, prompts: dict, max_tokens: int, timeout: float) -> dict:
    """One request per path; returns {path: seconds or 'error: ...'}."""
    base = {"model": stack.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    res = {}
    for path in ("colocated", "pd", "split"):
        try:
            if path == "colocated":
                res[path], _body = post(urls["decode"] + "/v1/completions", {**base, "prompt": prompts[path]}, timeout,
                                        direct=True)
            elif path == "pd":
                res[path], _body = post(urls["router"] + "/v1/completions", {**base, "prompt": prompts[path]}, timeout)
            else:
                kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
                t_p, out = post(urls["prefill"] + "/v1/completions",
                                {**base, "prompt": prompts[path], "max_tokens": 1, "kv_transfer_params": kv}, timeout,
                                direct=True)
                t_d, _body = post(urls["decode"] + "/v1/completions",
                                  {**base, "prompt": prompts[path], "kv_transfer_params": out["kv_transfer_params"]},
                                  timeout, direct=True)
                res["split_prefill"], res["split_decode"] = t_p, t_d
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            res[path] = f"error: {exc}"
    return res


def restart_to_ready(stack: Stack, name: str, urls: dict, timeout: float) -> dict:
    inst = next(i for i in stack.instances if i["name"] == name)
    url = instance_url(stack, inst)
    t0 = time.monotonic()
    stack.run(inst["host"], f"systemctl restart vllm-{name}.service", timeout=300)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:  # noqa: S310
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    ready = wait_until(healthy, timeout, interval=1.0)
    t_ready = time.monotonic() - t0
    routed = wait_until(stack.completion_ok, timeout, interval=1.0) if ready is not None else None
    t_routed = time.monotonic() - t0
    return {"instance": name, "health_200_s": None if ready is None else round(t_ready, 1),
            "routed_again_s": None if routed is None else round(t_routed, 1)}


def table(rep: dict) -> str:
    lines = ["| prompt tokens | colocated p50 / p99 s | P/D p50 / p99 s | P/D adds p50 / p99 ms | "
             "split: prefill p50 / decode-with-KV p50 / decode p99 s | errors |",
             "|---|---|---|---|---|---|"]
    for length, r in rep["lengths"].items():
        c, p, sp, sd = (r["stats"].get(k) or {} for k in ("colocated", "pd", "split_prefill", "split_decode"))
        add50 = (p.get("p50", 0) - c.get("p50", 0)) * 1000 if c and p else float("nan")
        add99 = (p.get("p99", 0) - c.get("p99", 0)) * 1000 if c and p else float("nan")
        lines.append(f"| {length} | {c.get('p50')} / {c.get('p99')} | {p.get('p50')} / {p.get('p99')} | "
                     f"{add50:.0f} / {add99:.0f} | {sp.get('p50')} / {sd.get('p50')} / {sd.get('p99')} | "
                     f"{r['errors']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("-i", "--inventory", default="inventory/local")
    ap.add_argument("--lengths", default="256,1024,3000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=12, help="requests per path and length")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, s")
    ap.add_argument("--idle-window", type=float, default=30.0, help="s of no traffic for the idle-CPU figure; 0: skip")
    ap.add_argument("--restart", default="", help="instance name: also measure its restart-to-ready")
    ap.add_argument("--out", default="reports/bench/pd-latency.json")
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.repeats < 2:
        ap.error("--repeats must be at least 2 (p99 of one value says nothing)")

    stack = Stack(args.inventory)
    urls = {"router": stack.router_url, "decode": instance_url(stack, stack.first("decode")),
            "prefill": instance_url(stack, stack.first("prefill"))}
    rep = {"schema": SCHEMA, "inventory": args.inventory, "urls": urls, "max_tokens": args.max_tokens,
           "repeats": args.repeats, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.idle_window > 0:
        rep["idle_cpu_pct_of_core"] = idle_cpu(stack, args.idle_window)
        print("idle CPU, % of one core over", args.idle_window, "s:", json.dumps(rep["idle_cpu_pct_of_core"]),
              flush=True)

    rng = random.Random(20261205)  # noqa: S311 - reproducible prompt seeds
    rep["lengths"] = {}
    for length in lengths:
        samples = {k: [] for k in PATHS}
        errors = []
        for n in range(args.repeats):
            prompts = {p: calibrated_prompt(stack, urls["decode"] + "/tokenize", length, rng.randrange(10**9))
                       for p in ("colocated", "pd", "split")}
            for path, val in one_round(stack, urls, prompts, args.max_tokens, args.timeout).items():
                if isinstance(val, str):
                    errors.append(f"{path}: {val}")
                else:
                    samples[path].append(val)
            print(f"  {length} tokens, round {n + 1}/{args.repeats}: "
                  + ", ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items() if v), flush=True)
        stats = {k: latency_stats(v) for k, v in samples.items()}
        rep["lengths"][str(length)] = {"stats": stats, "errors": len(errors), "error_samples": errors[:5],
                                       "raw": {k: [round(x, 4) for x in v] for k, v in samples.items()}}
        if stats["pd"] and stats["colocated"]:
            rep["lengths"][str(length)]["pd_adds_ms"] = {
                "p50": round(1000 * (percentile(samples["pd"], 50) - percentile(samples["colocated"], 50)), 1),
                "p99": round(1000 * (percentile(samples["pd"], 99) - percentile(samples["colocated"], 99)), 1)}
    if args.restart:
        rep["restart"] = restart_to_ready(stack, args.restart, urls, 900)
        print("restart:", json.dumps(rep["restart"]), flush=True)
    rep["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    print(table(rep))
    print(f"written: {out}")
    return 0 if all(r["errors"] == 0 for r in rep["lengths"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
