#!/usr/bin/env python3
"""Latency of NIXL READ transfers between two processes over UCX (TCP), at several progress-thread poll delays.

Why: the embedded default gives NIXL's UCX progress thread a poll delay (PD_NIXL_PROGRESS_DELAY_US, the vLLM
plugin of roles/vllm_install) so idle engines stop burning a core each. This measures what that costs a
transfer: a "prefill" process registers a buffer, a "decode" process READs it N times (as vLLM's
NixlConnector pulls KV blocks) and reports the latency distribution. Both processes load the plugin.

Run with the vLLM venv's interpreter (NIXL lives there):
    .cache/vllm-venv/bin/python bench/nixl_xfer_latency.py [--delays 0,1000] [--size-kib 256] [--count 200]
Prints one JSON line per delay. UCX_TLS defaults to tcp (what the test hosts use between hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# argv: role size_bytes count ; prefill prints its metadata + descs (hex) on stdout and waits for
# "done" on stdin; decode reads them from stdin, transfers, prints the result.
CHILD = r"""
import json, sys, time
import pd_nixl_progress_delay as plugin
plugin.register()
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
role, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
agent = nixl_agent(role, nixl_agent_config(num_threads=4))
buf = np.ones(size, dtype=np.uint8) if role == "prefill" else np.zeros(size, dtype=np.uint8)
addr = buf.ctypes.data
agent.register_memory(agent.get_reg_descs([(addr, size, 0, "")], "DRAM"))
xfer_descs = agent.get_xfer_descs([(addr, size, 0)], "DRAM")
if role == "prefill":
    print(json.dumps({"meta": agent.get_agent_metadata().hex(),
                      "descs": agent.get_serialized_descs(xfer_descs).hex()}), flush=True)
    sys.stdin.readline()
    sys.exit(0)
peer = json.loads(sys.stdin.readline())
name = agent.add_remote_agent(bytes.fromhex(peer["meta"]))
remote = agent.deserialize_descs(bytes.fromhex(peer["descs"]))
local = xfer_descs
while not agent.check_remote_metadata(name):
    time.sleep(0.01)
lat = []
for i in range(count + 5):
    h = agent.initialize_xfer("READ", local, remote, name, b"x")
    t0 = time.perf_counter()
    state = agent.transfer(h)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(h)
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(h)
    assert state == "DONE", state
    if i >= 5:  # first transfers open connections
        lat.append(dt * 1000)
assert int(buf.min()) == 1, "data did not arrive"
lat.sort()
q = lambda p: round(lat[min(len(lat) - 1, int(p * len(lat)))], 3)
print(json.dumps({"count": len(lat), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
                  "max_ms": round(lat[-1], 3), "mean_ms": round(sum(lat) / len(lat), 3)}), flush=True)
"""


def measure(delay: int, size: int, count: int) -> dict:
    env = dict(os.environ, PD_NIXL_PROGRESS_DELAY_US=str(delay))
    env.setdefault("UCX_TLS", "tcp")
    base = [sys.executable, "-c", CHILD]
    prefill = subprocess.Popen([*base, "prefill", str(size), str(count)], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        peer = ""
        while not peer.startswith('{"meta"'):  # NIXL may log to stdout first
            peer = prefill.stdout.readline()
            if not peer:
                raise RuntimeError("the prefill process exited before it printed its metadata")
        decode = subprocess.run([*base, "decode", str(size), str(count)], env=env, input=peer,
                                capture_output=True, text=True, timeout=600, check=False)
        if decode.returncode != 0:
            raise RuntimeError(decode.stderr[-2000:])
        return {"delay_us": delay, "size_kib": size // 1024, **json.loads(decode.stdout.splitlines()[-1])}
    finally:
        try:
            prefill.stdin.write("done\n")
            prefill.stdin.close()
        except BrokenPipeError:
            pass
        prefill.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="0,1000", help="comma-separated PD_NIXL_PROGRESS_DELAY_US values")
    ap.add_argument("--size-kib", type=int, default=256, help="bytes per transfer (KiB); ~one request's KV here")
    ap.add_argument("--count", type=int, default=200, help="timed transfers per delay")
    args = ap.parse_args()
    for delay in (int(d) for d in args.delays.split(",")):
        print(json.dumps(measure(delay, args.size_kib * 1024, args.count)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
