#!/usr/bin/env python3
"""SLA benchmark through the P/D router, stdlib only: the same client roles/pd_verify runs on the router host.

Random prompts of --input-len tokens (calibrated with the server's /tokenize), --output-len tokens each
(ignore_eos), --concurrency closed-loop workers, --num-prompts requests; prints vllm bench serve's summary
fields (mean/median/p99 TTFT and TPOT, throughput, goodput for --goodput ttft:<ms> tpot:<ms>) as JSON.

  python3 bench/sla_bench.py --base-url http://10.237.0.13:8000 --model tiny-pd \
      --tokenize-url http://10.237.0.11:8100/tokenize --input-len 1024 --output-len 32 \
      --concurrency 2 --num-prompts 8 --goodput ttft:2500 tpot:20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ansible_collections.b300.pd.roles.pd_verify.files import pd_verify as pv


def parse_goodput(items):
    slo = {"ttft": float("inf"), "tpot": float("inf")}
    for it in items or []:
        key, _sep, val = it.partition(":")
        if key not in slo or not val:
            raise SystemExit(f"--goodput: '{it}' is not ttft:<ms> or tpot:<ms>")
        slo[key] = float(val)
    return slo


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="router URL, e.g. http://10.237.0.13:8000")
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--tokenize-url", help="an instance's /tokenize to calibrate prompt lengths")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--goodput", nargs="*", default=[], help="ttft:<ms> tpot:<ms>")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--save-result", help="write the JSON summary here too")
    a = ap.parse_args(argv)
    slo = parse_goodput(a.goodput)
    maker = pv.PromptMaker(a.tokenize_url, a.model, api_key=a.api_key)
    prompts = [maker.make(a.input_len, 5000 + i)[0] for i in range(a.num_prompts)]
    records, dur = pv.run_bench(a.base_url.rstrip("/"), a.model, prompts, a.output_len, a.concurrency,
                                api_key=a.api_key, timeout=a.timeout)
    out = pv.summarize_bench(records, dur, slo["ttft"], slo["tpot"])
    out["params"] = {"input_len": a.input_len, "output_len": a.output_len, "concurrency": a.concurrency,
                     "num_prompts": a.num_prompts, "goodput": a.goodput, "dataset": "random"}
    out["errors"] = [r["error"] for r in records if "error" in r][:5]
    text = json.dumps(out, indent=2)
    print(text)
    if a.save_result:
        Path(a.save_result).write_text(text + "\n")
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
