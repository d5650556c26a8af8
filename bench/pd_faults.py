#!/usr/bin/env python3
"""Fault tests under load: what a user of the P/D stack sees when a part fails, and how long recovery takes.

For each scenario a steady request stream runs through the router (bench/pd_load_generator.py's LoadGenerator),
the fault is injected on the real host (through Ansible ad-hoc commands, the same ssh path the playbooks use), and the
script waits for recovery, keeps the load for a settle period, then reports completed / failed requests (by
class), the longest gap without a completion, and the recovery time.

    .venv/bin/python bench/pd_faults.py -i inventory/local [--scenarios kill-prefill,kill-decode,...]
        [--concurrency 2 | --rate R [--concurrency CAP]] [--repeats N] [--max-failed 0] [--shed-ok]
        [--out reports/faults/faults-latest.json]

Load: closed loop with --concurrency clients (default 2), or with --rate R an open loop at R requests/s (the
concurrency option, default 64, caps the requests in flight). --repeats N runs the scenario list N times; before
every scenario the stack must be fully recovered (every instance's /health 200, every P/D router unit's /health 200, a
completion through the front door), then --ready-settle-s of quiet. The summary counts failed requests per run, per
scenario and load mode, and in total; exit 1 when the total exceeds --max-failed (default 0) or a scenario could not
finish. Requests the front door shed (429 with Retry-After) are reported apart; they count as failed unless --shed-ok
(for an open loop near capacity: while a killed instance restarts the cluster serves less, and admission refuses at
once what it cannot serve within the SLA instead of queueing it).

Scenarios:
  kill-prefill   kill -9 the main process of the first prefill instance (in-flight prefills and KV transfers die);
                 recovered = systemd restarted it and its /health answers 200
  kill-prefill-unit  systemctl kill -s KILL of the first prefill instance's unit: every process of its cgroup (the
                 engine core and workers too) dies at once; recovered as kill-prefill
  kill-decode    the same as kill-prefill for the first decode instance
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
SCENARIOS = ("kill-prefill", "kill-prefill-unit", "kill-decode", "kill-router", "stop-router", "corrupt-shard",
             "disk-full")
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


def kill_instance(stack: Stack, pool: str, timeout: float, whole_unit: bool = False) -> dict:
    """kill -9 of the first `pool` instance's main PID, or (whole_unit) SIGKILL of every process of its unit's
    cgroup; recovered = systemd restarted it, its /health answers 200 and a completion through the front door."""
    inst = stack.first(pool)
    unit = f"vllm-{inst['name']}.service"
    before = int(stack.run(inst["host"], f"systemctl show -p NRestarts --value {unit}"))
    pid = stack.run(inst["host"], f"systemctl show -p MainPID --value {unit}")
    if whole_unit:
        stack.run(inst["host"], f"systemctl kill -s KILL {unit}")
    else:
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
            "killed": "cgroup" if whole_unit else "main_pid", "healthy_after_s": recovered,
            "routing_after_s": None if routed is None else
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


def stack_ready(stack: Stack) -> bool:
    """Every vLLM instance's and every P/D router unit's /health answers 200 on its host, and a completion through
    the front door succeeds."""
    checks: dict[str, list[int]] = {}
    for inst in stack.instances:
        checks.setdefault(inst["host"], []).append(inst["http_port"])
    for r in stack.cluster.get("routers") or []:
        checks.setdefault(r["host"], []).extend(u["port"] for u in r.get("units") or [] if u.get("mode") == "pd")
    for host, ports in checks.items():
        cmd = "echo " + " ".join(f"$(curl -s -o /dev/null -w '%{{http_code}}' -m 5 http://127.0.0.1:{p}/health)"
                                 for p in ports)
        codes = stack.run(host, cmd, check=False).split()
        if codes != ["200"] * len(ports):
            return False
    return stack.completion_ok()


def wait_ready(stack: Stack, timeout: float, settle_s: float) -> float | None:
    """Seconds until the stack was fully recovered (stack_ready), then settle_s of quiet; None on timeout."""
    took = wait_until(lambda: stack_ready(stack), timeout, interval=3)
    if took is not None:
        time.sleep(settle_s)
    return took


def load_mode(args) -> str:
    return "open" if getattr(args, "rate", None) else "closed"


def run_scenario(stack: Stack, name: str, args) -> dict:
    rate = getattr(args, "rate", None)
    conc = args.concurrency if args.concurrency else (None if rate else 2)
    load = LoadGenerator(url=stack.router_url, model=stack.model, concurrency=conc, rate=rate,
                         api_key=client_api_key(),
                         max_tokens=args.max_tokens, prompt_words=args.prompt_words, timeout=args.request_timeout,
                         bucket=1.0, max_failed=10**9, min_completed=0)
    load.start()
    time.sleep(args.warm_s)
    t_fault = time.monotonic()
    try:
        if name == "kill-prefill":
            detail = kill_instance(stack, "prefill", args.recovery_timeout)
        elif name == "kill-prefill-unit":
            detail = kill_instance(stack, "prefill", args.recovery_timeout, whole_unit=True)
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
    return {"scenario": name, "load_mode": load_mode(args), "rate": rate, "concurrency": load.cfg.workers,
            "fault_and_recovery_s": fault_s, **detail,
            "requests": {k: rep[k] for k in ("sent", "completed", "failed", "failures", "unfinished",
                                             "retry_after_missing")},
            "longest_completion_gap_s": rep["longest_completion_gap_s"],
            "latency_s": rep["latency_s"], "error_samples": rep["error_samples"]}


def shed_of(requests: dict) -> int:
    """Requests the front door refused for overload the way it is built to: HTTP 429 with a Retry-After header. A 429
    without one is a failure like any other status."""
    return max(0, requests["failures"].get("http_429", 0) - requests.get("retry_after_missing", 0))


def summarize(results: list[dict], max_failed: int = 0, shed_ok: bool = False) -> dict:
    """Failed requests per run (scenario, load mode), per scenario and load mode, and in total. With shed_ok a 429
    with Retry-After is counted as shed, not failed (open loop near capacity: a crash lowers the capacity until the
    instance is back, and admission refuses what the rest cannot serve within the SLA); shed is reported either
    way."""
    by: dict[str, dict] = {}
    total = shed_total = 0
    runs_with_failures = 0
    for r in results:
        key = f"{r['scenario']}/{r.get('load_mode', 'closed')}"
        e = by.setdefault(key, {"runs": 0, "failed": 0, "shed": 0, "sent": 0, "failed_per_run": [],
                                "shed_per_run": []})
        shed = shed_of(r["requests"])
        failed = r["requests"]["failed"] - (shed if shed_ok else 0)
        e["runs"] += 1
        e["failed"] += failed
        e["shed"] += shed
        e["sent"] += r["requests"]["sent"]
        e["failed_per_run"].append(failed)
        e["shed_per_run"].append(shed)
        total += failed
        shed_total += shed
        runs_with_failures += bool(failed)
    errors = [f"{r['scenario']} (run {r.get('run', 1)})" for r in results if "error" in r]
    return {"runs": len(results), "failed_total": total, "shed_total": shed_total, "shed_ok": shed_ok,
            "sent_total": sum(r["requests"]["sent"] for r in results), "max_failed": max_failed,
            "runs_with_failures": runs_with_failures, "by_scenario": by, "scenario_errors": errors,
            "passed": total <= max_failed and not errors}


def run_all(stack: Stack, names: list[str], args, out: Path | None = None, log=print) -> dict:
    """The scenario list args.repeats times, each after the stack is fully recovered -> the report (written to
    `out` after every scenario: a later one that fails or is interrupted loses nothing measured)."""
    repeats = getattr(args, "repeats", 1) or 1
    max_failed = getattr(args, "max_failed", 0)
    results: list[dict] = []
    rep: dict = {}
    for run in range(1, repeats + 1):
        for name in names:
            ready = wait_ready(stack, args.recovery_timeout, getattr(args, "ready_settle_s", 5.0))
            if ready is None:
                res = {"scenario": name, "run": run, "load_mode": load_mode(args),
                       "error": f"stack not recovered within {args.recovery_timeout:g} s before the run",
                       "requests": {"sent": 0, "completed": 0, "failed": 0, "failures": {}, "unfinished": 0}}
            else:
                log(f"--- {name} (run {run}/{repeats}, {load_mode(args)} loop)")
                res = {"run": run, "ready_after_s": ready, **run_scenario(stack, name, args)}
            results.append(res)
            log(json.dumps({k: v for k, v in res.items() if k not in ("error_samples", "latency_s")}))
            rep = {"inventory": getattr(args, "inventory", None), "router": stack.router_url,
                   "concurrency": args.concurrency, "rate": getattr(args, "rate", None),
                   "load_mode": load_mode(args), "repeats": repeats, "results": results,
                   "summary": summarize(results, max_failed, getattr(args, "shed_ok", False))}
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(rep, indent=2) + "\n")
    return rep


def print_summary(summary: dict, log=print) -> None:
    for key, e in summary["by_scenario"].items():
        log(f"  {key}: {e['runs']} runs, failed {e['failed']} of {e['sent']} (per run {e['failed_per_run']}), "
            f"shed {e['shed']} (per run {e['shed_per_run']})")
    shed = "not failed" if summary["shed_ok"] else "counted as failed"
    log(f"shed (429 with Retry-After, {shed}): {summary['shed_total']} of {summary['sent_total']}")
    log(f"failed requests in total: {summary['failed_total']} over {summary['runs']} runs "
        f"(max {summary['max_failed']}): {'PASS' if summary['passed'] else 'FAIL'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--inventory", default="inventory/local")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--concurrency", type=int, default=None,
                    help="closed loop: clients (default 2); with --rate: the cap on requests in flight (default 64)")
    ap.add_argument("--rate", type=float, default=None, help="open loop at this many requests/s")
    ap.add_argument("--repeats", type=int, default=1, help="run the scenario list this many times")
    ap.add_argument("--max-failed", type=int, default=0, help="failed requests allowed over all runs")
    ap.add_argument("--shed-ok", action="store_true",
                    help="count a 429 with Retry-After as shed, not failed (open loop near capacity, where a crash "
                         "lowers the capacity until the instance is back); shed is reported either way")
    ap.add_argument("--ready-settle-s", type=float, default=5.0, help="quiet after the stack is recovered, "
                    "before each scenario")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--warm-s", type=float, default=20, help="load before the fault")
    ap.add_argument("--settle-s", type=float, default=20, help="load after recovery")
    ap.add_argument("--router-down-s", type=float, default=10)
    ap.add_argument("--recovery-timeout", type=float, default=900)
    ap.add_argument("--out", default="reports/faults/faults-latest.json")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        ap.error(f"--scenarios: unknown {bad}; choose from {', '.join(SCENARIOS)}")
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate {args.rate}: must be > 0 requests/s (leave it out for a closed loop)")
    if args.repeats < 1 or args.max_failed < 0 or (args.concurrency is not None and args.concurrency < 1):
        ap.error("--repeats and --concurrency must be >= 1, --max-failed >= 0")
    if args.concurrency is None and args.rate is None:
        args.concurrency = 2
    stack = Stack(args.inventory)
    out = ROOT / args.out
    rep = run_all(stack, names, args, out, log=lambda m: print(m, flush=True))
    print(f"report: {out}")
    summary = rep["summary"]
    print_summary(summary)
    if summary["scenario_errors"]:
        print(f"scenarios that could not finish: {', '.join(summary['scenario_errors'])} (see 'error' in the "
              "report)", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
