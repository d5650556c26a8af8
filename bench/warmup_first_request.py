#!/usr/bin/env python3
"""After a deploy or a rolling change: does the first client request of each warmed feature cost more than the
same request warm, on every instance? (issue 31: <= 500 ms more, logprobs first.)

For every vLLM instance of the cluster view and every feature of the inventory's `pd_warmup_features` (the warm-up's
own list, so what was warmed is what is measured), it sends the feature's request straight to the instance three
times with prompts the warm-up never sent (no prefix-cache hit): the first is the cold one, the later two the warm
one (their minimum). Features the instance cannot serve by its flags are skipped with the warm-up's own reason.
Run it right after `scripts/up` or a rolling change, before any other traffic reached the instances.

    .venv/bin/python bench/warmup_first_request.py -i inventory/local [--api-key-file .cache/...] [--json out.json]

Exit 0 when every (instance, feature) stays within --max-extra-s, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ansible_collections.b300.pd.bench import pd_cluster
from ansible_collections.b300.pd.plugins.module_utils import pd_warmup

# Features measured first: logprobs is the one whose first use compiled for 11-19 s (issue 31).
FIRST = ("logprobs",)


def fresh_body(body, n_tokens, seed):
    """The request with a prompt of the same length the warm-up never sent (a prefix-cache miss)."""
    out = copy.deepcopy(body)
    text = pd_warmup.make_prompt(n_tokens, seed)[0]
    if "prompt" in out:
        out["prompt"] = text
    else:
        out["messages"] = [{"role": "user", "content": text}]
    return out


def post(url, body, api_key, timeout):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the inventory's instance URL)
            resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        err.read()
        status = err.code
    return status, time.perf_counter() - start


def instance_flags(hostvars, inst):
    hv = hostvars.get(inst["host"], {})
    entry = next((i for i in hv.get("pd_instances") or [] if i.get("name") == inst["name"]), {})
    return pd_warmup.merge_flags(hv.get("pd_vllm_flags_common") or {},
                                 (hv.get("pd_vllm_flags_pool") or {}).get(inst["pool"]) or {},
                                 entry.get("extra_flags") or {})


def measure(view, hostvars, *, api_key, timeout, warm_repeats=2):
    rows = []
    for inst in view["instances"]:
        hv = hostvars.get(inst["host"], {})
        features = hv.get("pd_warmup_features") or list(pd_warmup.DEFAULT_FEATURES)
        features = [f for f in FIRST if f in features] + [f for f in features if f not in FIRST]
        model = hv.get("pd_served_model_name") or hv.get("pd_model_name")
        plan = pd_warmup.warmup_plan(features, model, flags=instance_flags(hostvars, inst), max_tokens=8)
        for name, reason in plan["skipped"].items():
            rows.append({"instance": inst["name"], "feature": name, "skipped": reason})
        for k, req in enumerate(plan["requests"]):
            url = inst["url"] + req["path"]
            seeds = [7000 + 10 * k + i for i in range(1 + warm_repeats)]
            timings = [post(url, fresh_body(req["body"], req["context_tokens"], s), api_key, timeout) for s in seeds]
            statuses = sorted({status for status, _seconds in timings})
            first, warm = timings[0][1], min(seconds for _status, seconds in timings[1:])
            rows.append({"instance": inst["name"], "feature": req["feature"], "path": req["path"],
                         "context_tokens": req["context_tokens"], "first_s": round(first, 4),
                         "warm_s": round(warm, 4), "extra_s": round(first - warm, 4), "statuses": statuses})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("-i", "--inventory", default="inventory/local")
    ap.add_argument("--api-key-file", type=Path, default=Path(__file__).resolve().parents[1] / ".cache/worker/api-key",
                    help="the instances' key (pd_router_api_key); default the local stack's .cache/worker/api-key "
                         "(scripts/bootstrap.d/65-worker-key), none sent when that file does not exist")
    ap.add_argument("--max-extra-s", type=float, default=0.5)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    groups, hostvars = pd_cluster.inventory_data(args.inventory)
    view = pd_cluster.view_from(groups, hostvars)
    api_key = args.api_key_file.read_text().strip() if args.api_key_file and args.api_key_file.is_file() else None
    rows = measure(view, hostvars, api_key=api_key, timeout=args.timeout_s)
    bad = [r for r in rows if "skipped" not in r and (r["extra_s"] > args.max_extra_s or r["statuses"] != [200])]
    print(f"{'instance':<12} {'feature':<18} {'path':<22} {'first s':>8} {'warm s':>8} {'extra s':>8}  status")
    for r in rows:
        if "skipped" in r:
            print(f"{r['instance']:<12} {r['feature']:<18} skipped: {r['skipped']}")
            continue
        print(f"{r['instance']:<12} {r['feature']:<18} {r['path']:<22} {r['first_s']:>8.3f} {r['warm_s']:>8.3f} "
              f"{r['extra_s']:>8.3f}  {r['statuses']}")
    worst = max((r["extra_s"] for r in rows if "skipped" not in r), default=0.0)
    print(f"worst first-request extra: {worst:.3f} s (bar {args.max_extra_s} s); "
          f"{'PASS' if not bad else f'FAIL: {len(bad)} over the bar or not 200'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "max_extra_s": args.max_extra_s, "pass": not bad}, indent=1))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
