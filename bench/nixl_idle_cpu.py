#!/usr/bin/env python3
"""CPU used by an idle NIXL agent (UCX backend), with NIXL's default progress thread and with the poll delay
that roles/vllm_install's plugin applies (PD_NIXL_PROGRESS_DELAY_US, files/pd_nixl_progress_delay.py).

Run it with the vLLM venv's interpreter (NIXL lives there):
    .cache/vllm-venv/bin/python bench/nixl_idle_cpu.py [--seconds 10] [--delays 0,1000]
Each delay runs in a fresh process: create an agent as vLLM's NixlConnector does (num_threads=4), sleep,
and report the process's CPU time / wall time. Prints one JSON line per delay.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time
import pd_nixl_progress_delay as plugin
plugin.register()
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("idle-bench", nixl_agent_config(num_threads=4))
time.sleep(1)  # let the progress thread start
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep(float(sys.argv[1]))
r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"delay_us": int(os.environ.get("PD_NIXL_PROGRESS_DELAY_US") or 0),
                  "applied_delay_us": plugin.applied["delay_us"], "seconds": round(t1 - t0, 2),
                  "cpu_percent_of_one_core": round(100 * cpu / (t1 - t0), 1),
                  "sys_percent": round(100 * (r1.ru_stime - r0.ru_stime) / (t1 - t0), 1)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="idle time measured per delay")
    ap.add_argument("--delays", default="0,1000", help="comma-separated PD_NIXL_PROGRESS_DELAY_US values")
    args = ap.parse_args()
    rc = 0
    for delay in [int(d) for d in args.delays.split(",")]:
        env = dict(os.environ, PD_NIXL_PROGRESS_DELAY_US=str(delay), UCX_TLS=os.environ.get("UCX_TLS", "tcp,self,sm"))
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.seconds)], env=env,
                              capture_output=True, text=True, timeout=args.seconds + 120, check=False)
        line = proc.stdout.strip().splitlines()[-1:] or [""]
        if proc.returncode != 0 or not line[0].startswith("{"):
            print(f"delay {delay}: failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
            rc = 1
            continue
        print(line[0], flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
