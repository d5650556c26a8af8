#!/usr/bin/env python3
"""Fault tests under load: what a user of the P/D stack sees when a part fails, and how long recovery takes.

For each scenario a steady request stream runs through the router (bench/pd_load_generator.py's LoadGenerator),
the fault is injected on the real host (through Ansible ad-hoc commands, the same ssh path the playbooks use), and the
script waits for recovery, keeps the load for a settle period, then reports completed / failed requests (by
class), the longest gap without a completion, and the recovery time.

    .venv/bin/python bench/pd_faults.py -i inventory/local [--scenarios kill-prefill,kill-decode,...]
        [--concurrency 2] [--out reports/faults/faults-latest.json]

Scenarios:
  kill-prefill   kill -9 the main process of the first prefill instance (in-flight prefills and KV transfers die);
                 recovered = systemd restarted it and its /health answers 200
  kill-decode    the same for the first decode instance
  kill-router    kill -9 the first P/D router unit of the first router host (the front door's other routers serve);
                 recovered = systemd restarted it and its /health answers 200
  stop-router    systemctl stop that router unit for --router-down-s seconds, then start it; recovered = a
                 completion through the front door succeeds again
  corrupt-shard  overwrite 4 KiB in the middle of the largest weight file under pd_model_path on one vLLM host
                 (the served instance keeps its weights in memory), then run playbooks/provision.yml on that host:
                 model_weights' full verification must find the damaged file and fetch it again; recovered = the
                 playbook passed and the file's sha256 matches the manifest again
  disk-full      fill the filesystem of pd_model_path on the decode host (refused when that is the host's root
                 filesystem: the model path must be a disk of its own, as inventory/local's test hosts have), damage
                 the largest weight file, run playbooks/provision.yml on the host: model_weights' disk preflight must
                 refuse before writing anything (the served instances keep their weights in memory); then remove
                 the filler and run provision.yml again; recovered = it passed and the file is intact again

Every address, port and name comes from the inventory (ansible-inventory). Nothing here is specific to the local
inventory except that the router's port must be reachable from where this runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from ansible_collections.b300.pd.bench.pd_cluster import inventory_data, view_from  # noqa: E402
from ansible_collections.b300.pd.bench.pd_load_config import client_api_key  # noqa: E402
from ansible_collections.b300.pd.bench.pd_load_generator import LoadGenerator  # noqa: E402

VENV_BIN = ROOT / ".venv" / "bin"
SCENARIOS = ("kill-prefill", "kill-decode", "kill-router", "stop-router", "corrupt-shard", "disk-full")
FILLER = ".pd-fault-disk-full"


def sh(cmd: list[str], timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    return proc


class Stack:
    """The topology, read from the inventory, and a way to run commands on its hosts."""

    def __init__(self, inventory: str):
        self.inventory = inventory
        groups, hv = inventory_data(inventory)
        self.hostvars = hv
        # Addresses, URLs and ports: the cluster view (bench/pd_cluster.py, what validate.yml publishes).
        self.cluster = view_from(groups, hv)
        raw = {i["name"]: i for h in groups["vllm_hosts"] for i in hv[h]["pd_instances"]}
        self.instances = [{**raw[i["name"]], "host": i["host"], "address": i["address"], "url": i["url"]}
                          for i in self.cluster["instances"]]
        router = self.cluster["routers"][0]["host"]
        self.router_host = router
        self.router_url = self.cluster["router_url"]
        # The first P/D router unit of the first router host (the front door has the others).
        self.router_unit = next(u for u in hv[router]["pd_router_units"] if u["mode"] == "pd")
        self.model = hv[router]["pd_served_model_name"]

    def run(self, host: str, command: str, timeout: int = 120, check: bool = True) -> str:
        proc = sh([str(VENV_BIN / "ansible"), "-i", self.inventory, host, "-b", "-o", "-m", "ansible.builtin.shell",
                   "-a", command], timeout=timeout, check=check)
        out = proc.stdout
        # one-line output: "host | CHANGED | rc=0 | (stdout) text"
        return out.split("(stdout)", 1)[1].strip() if "(stdout)" in out else out.strip()

    def first(self, pool: str) -> dict:
        return next(i for i in self.instances if i["pool"] == pool)

    def completion_ok(self) -> bool:
        body = json.dumps({"model": self.model, "prompt": "Q: 2+2= A:", "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.router_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {client_api_key()}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return bool(json.load(resp).get("choices"))
        except Exception:  # noqa: BLE001 - any failure means "not yet"
            return False


def wait_until(pred, timeout: float, interval: float = 2.0) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return round(time.monotonic() - t0, 1)
        time.sleep(interval)
    return None


def kill_instance(stack: Stack, pool: str, timeout: float) -> dict:
    inst = stack.first(pool)
    unit = f"vllm-{inst['name']}.service"
    before = int(stack.run(inst["host"], f"systemctl show -p NRestarts --value {unit}"))
    pid = stack.run(inst["host"], f"systemctl show -p MainPID --value {unit}")
    stack.run(inst["host"], f"kill -9 {pid}")
    t0 = time.monotonic()

    def healthy_again() -> bool:
        # One line: ansible's one-line output (-o) escapes newlines.
        out = stack.run(inst["host"], f"echo $(systemctl show -p NRestarts --value {unit}) "
                        f"$(curl -s -o /dev/null -w '%{{http_code}}' -m 5 http://127.0.0.1:{inst['http_port']}/health)",
                        check=False)
        lines = out.split()
        return len(lines) == 2 and int(lines[0]) > before and lines[1] == "200"

    recovered = wait_until(healthy_again, timeout, interval=3)
    routed = wait_until(stack.completion_ok, 120) if recovered is not None else None
    return {"instance": inst["name"], "host": inst["host"], "killed_pid": pid,
            "healthy_after_s": recovered, "routing_after_s": None if routed is None else
            round(time.monotonic() - t0, 1)}


def stop_router(stack: Stack, down_s: float, timeout: float) -> dict:
    unit = stack.router_unit["name"]
    stack.run(stack.router_host, f"systemctl stop {unit}")
    time.sleep(down_s)
    stack.run(stack.router_host, f"systemctl start {unit}")
    return {"router_unit": unit, "down_s": down_s, "routing_after_start_s": wait_until(stack.completion_ok, timeout)}


def kill_router(stack: Stack, timeout: float) -> dict:
    """kill -9 of one P/D router unit's process (systemd restarts it); the front door has the others."""
    unit = stack.router_unit
    svc = f"{unit['name']}.service"
    before = int(stack.run(stack.router_host, f"systemctl show -p NRestarts --value {svc}"))
    pid = stack.run(stack.router_host, f"systemctl show -p MainPID --value {svc}")
    stack.run(stack.router_host, f"kill -9 {pid}")

    def answering_again() -> bool:
        out = stack.run(stack.router_host, f"echo $(systemctl show -p NRestarts --value {svc}) "
                        f"$(curl -s -o /dev/null -w '%{{http_code}}' -m 5 http://127.0.0.1:{unit['port']}/health)",
                        check=False).split()
        return len(out) == 2 and int(out[0]) > before and out[1] == "200"

    return {"router_unit": unit["name"], "killed_pid": pid,
            "healthy_after_s": wait_until(answering_again, timeout, interval=2)}


def largest_weight_file(stack: Stack, host: str) -> str:
    path = stack.hostvars[host]["pd_model_path"]
    return stack.run(host, f"find -L {path}/ -type f -printf '%s %p\\n' | sort -n | tail -1 | cut -d' ' -f2-")


def damage(stack: Stack, host: str, target: str) -> None:
    stack.run(host, f"real=$(readlink -f {target}); size=$(stat -c %s $real); "
                    f"dd if=/dev/urandom of=$real bs=4096 count=1 seek=$((size / 8192)) conv=notrunc status=none")


def sha256(stack: Stack, host: str, target: str) -> str:
    return stack.run(host, f"sha256sum {target} | cut -d' ' -f1")


def provision(stack: Stack, host: str, timeout: float) -> subprocess.CompletedProcess:
    return sh([str(VENV_BIN / "ansible-playbook"), "-i", stack.inventory, "playbooks/provision.yml", "--limit", host],
              timeout=int(timeout), check=False)


def corrupt_shard(stack: Stack, timeout: float) -> dict:
    host = stack.first("decode")["host"]
    target = largest_weight_file(stack, host)
    before = sha256(stack, host, target)
    damage(stack, host, target)
    damaged = sha256(stack, host, target)
    t0 = time.monotonic()
    proc = provision(stack, host, timeout)
    after = sha256(stack, host, target)
    # model_weights' summary (per-file states, bytes transferred); the output callback wraps it over lines.
    repair_lines = re.findall(r'\{"ok"[^{}]*\}; transferred [0-9.]+ \w+', " ".join(proc.stdout.split()))
    return {"host": host, "file": target, "damaged": damaged != before, "playbook_rc": proc.returncode,
            "playbook_s": round(time.monotonic() - t0, 1), "restored": after == before,
            "model_weights_said": repair_lines[:4]}


def disk_full(stack: Stack, timeout: float) -> dict:
    host = stack.first("decode")["host"]
    root = stack.hostvars[host].get("pd_model_root") or os.path.dirname(stack.hostvars[host]["pd_model_path"])
    mount = stack.run(host, f"findmnt -n -o TARGET --target {root}")
    if mount == "/":
        raise RuntimeError(f"disk-full: {root} on {host} is on the root filesystem; filling it would fill the whole "
                           "host. Run this scenario where the model path is a disk of its own.")
    filler = f"{mount.rstrip('/')}/{FILLER}"
    target = largest_weight_file(stack, host)
    before = sha256(stack, host, target)
    t0 = time.monotonic()
    try:
        # fallocate takes every free block at once; dd is the fallback where the filesystem lacks it.
        stack.run(host, f"fallocate -l $(( $(stat -f -c '%a*%S' {mount}) )) {filler} || "
                        f"dd if=/dev/zero of={filler} bs=1M status=none; sync; true")
        free_kib = int(stack.run(host, f"df --output=avail -k {mount} | tail -1"))
        damage(stack, host, target)
        refused = provision(stack, host, timeout)
        said = [ln.strip() for ln in (refused.stdout + refused.stderr).splitlines() if "disk space" in ln][:2]
        damaged_after_refusal = sha256(stack, host, target) != before
    finally:
        stack.run(host, f"rm -f {filler}")
    repaired = provision(stack, host, timeout)
    return {"host": host, "filesystem": mount, "free_kib_when_full": free_kib,
            "provision_when_full_rc": refused.returncode, "model_weights_said": said,
            "file_untouched_by_refused_run": damaged_after_refusal,
            "provision_after_free_rc": repaired.returncode, "restored": sha256(stack, host, target) == before,
            "recovered_s": round(time.monotonic() - t0, 1)}


def run_scenario(stack: Stack, name: str, args) -> dict:
    load = LoadGenerator(url=stack.router_url, model=stack.model, concurrency=args.concurrency,
                         api_key=client_api_key(),
                         max_tokens=args.max_tokens, prompt_words=args.prompt_words, timeout=args.request_timeout,
                         bucket=1.0, max_failed=10**9, min_completed=0)
    load.start()
    time.sleep(args.warm_s)
    t_fault = time.monotonic()
    try:
        if name == "kill-prefill":
            detail = kill_instance(stack, "prefill", args.recovery_timeout)
        elif name == "kill-decode":
            detail = kill_instance(stack, "decode", args.recovery_timeout)
        elif name == "kill-router":
            detail = kill_router(stack, args.recovery_timeout)
        elif name == "stop-router":
            detail = stop_router(stack, args.router_down_s, args.recovery_timeout)
        elif name == "corrupt-shard":
            detail = corrupt_shard(stack, args.recovery_timeout)
        elif name == "disk-full":
            detail = disk_full(stack, args.recovery_timeout)
        else:
            raise ValueError(name)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
        # Recorded, not raised: the scenarios measured before this one keep their figures, and the load stops.
        detail = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    fault_s = round(time.monotonic() - t_fault, 1)
    time.sleep(args.settle_s)
    rep = load.stop()
    return {"scenario": name, "fault_and_recovery_s": fault_s, **detail,
            "requests": {k: rep[k] for k in ("sent", "completed", "failed", "failures", "unfinished")},
            "longest_completion_gap_s": rep["longest_completion_gap_s"],
            "latency_s": rep["latency_s"], "error_samples": rep["error_samples"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--inventory", default="inventory/local")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--warm-s", type=float, default=20, help="load before the fault")
    ap.add_argument("--settle-s", type=float, default=20, help="load after recovery")
    ap.add_argument("--router-down-s", type=float, default=10)
    ap.add_argument("--recovery-timeout", type=float, default=900)
    ap.add_argument("--out", default="reports/faults/faults-latest.json")
    args = ap.parse_args()
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        ap.error(f"--scenarios: unknown {bad}; choose from {', '.join(SCENARIOS)}")
    stack = Stack(args.inventory)
    results = []
    for name in names:
        print(f"--- {name}", flush=True)
        res = run_scenario(stack, name, args)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("error_samples", "latency_s")}), flush=True)
        # Written after every scenario: a later one that fails or is interrupted loses nothing measured.
        out = ROOT / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"inventory": args.inventory, "router": stack.router_url,
                                   "concurrency": args.concurrency, "results": results}, indent=2) + "\n")
    print(f"report: {ROOT / args.out}")
    failed = [r["scenario"] for r in results if "error" in r]
    if failed:
        print(f"scenarios that could not finish: {', '.join(failed)} (see 'error' in the report)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
