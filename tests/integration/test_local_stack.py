"""The embedded default end to end: inventory/local comes up from scratch on real test hosts.

Runs in order (pytest -x): bring-up + verify report, Prometheus targets, a second site.yml run with
changed=0, a kill -9 of the decode engine that systemd must recover from, and (marker `upgrade`, only in
`scripts/test upgrade`) the one change path: a flag change, a revision switch and a rollback, each applied by
plain site.yml under load with 0 failed requests. Every address,
port and instance name comes from the inventory (ansible-inventory), none is written here.

Figures are printed as one JSON line per test and written to reports/ci/<test>.json.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
# inventory/local by default; PD_TEST_INVENTORY=inventory/local-2d runs the same tests on two decode instances (same
# test hosts, issue #34).
INVENTORY = os.environ.get("PD_TEST_INVENTORY", "inventory/local")
REPORTS = ROOT / "reports" / "ci"
ENV = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), PATH=f"{VENV_BIN}:{os.environ['PATH']}")
from ansible_collections.b300.pd.bench.pd_cluster import inventory_data, view_from  # noqa: E402
from ansible_collections.b300.pd.bench.pd_load_config import client_api_key  # noqa: E402
from ansible_collections.b300.pd.bench.pd_load_generator import LoadGenerator  # noqa: E402
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.metrics import (  # noqa: E402
    metric_sum,
    parse_prometheus,
)

# The steady load of the fault and change tests: open loop, 4 requests a second (at most 4 in flight), through the
# front door. Closed-loop workers (concurrency 2, as fast as the stack answers: ~20 req/s) kept both cores busy
# serving the test's own load, so every Ansible task and every engine start of the change under test ran slower: a
# decode-only flag change took 323 s that way and 188 s at 4 req/s (765 requests, 0 failed; 2026-12-06). Each
# change still sends hundreds of requests through every drain, restart and return to the router, and any failed
# one fails the test.
STEADY_LOAD = {"rate": 4.0, "concurrency": 4, "max_tokens": 8, "prompt_words": 32, "timeout": 300}


def record(name: str, figures: dict) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\n[{name}] {json.dumps(figures)}", flush=True)


def run(cmd: list[str], timeout: int, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        out = proc.stdout + proc.stderr
        # Every host's failure, not only the last one's (the tail alone hid an earlier host's failed task).
        fatal = [out[m.start():m.start() + 1500] for m in re.finditer(r"^(fatal|failed): \[", out, re.M)][:6]
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n" + "\n...\n".join(fatal) + f"\n...\n{out[-4000:]}")
    return proc


def playbook(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    return run([str(VENV_BIN / "ansible-playbook"), "-i", INVENTORY, *args], timeout=timeout)


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines -> {host: {ok: n, changed: n, failed: n, ...}}."""
    hosts: dict[str, dict[str, int]] = {}
    for line in output.rsplit("PLAY RECAP", maxsplit=1)[-1].splitlines():
        m = re.match(r"^(\S+)\s+:\s+(.*)$", line.strip())
        if m:
            hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return hosts


def http_json(url: str, payload: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    # The front door's key (the instances ignore it).
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {client_api_key()}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def cluster() -> tuple[dict, dict, dict]:
    """(the cluster view, groups, hostvars) of the inventory: addresses, URLs and ports as validate.yml publishes
    them (bench/pd_cluster.py: the same plugins/module_utils/pd_topology.py code)."""
    groups, hostvars = inventory_data(INVENTORY)
    return view_from(groups, hostvars), groups, hostvars


@pytest.fixture(scope="session")
def inventory() -> dict:
    view, _groups, hostvars = cluster()
    raw = {i["name"]: i for h in dict.fromkeys(v["host"] for v in view["instances"])
           for i in hostvars[h]["pd_instances"]}
    # Host-name order, as before (a stable sort keeps each host's own order).
    instances = [{**raw[i["name"]], "host": i["host"], "address": i["address"], "url": i["url"]}
                 for i in sorted(view["instances"], key=lambda i: i["host"])]
    router = view["routers"][0]["host"]
    return {
        "hostvars": hostvars,
        "instances": instances,
        "router_host": router,
        "router_url": view["router_url"],
        "prometheus_url": view["prometheus_url"],
        "model": hostvars[router]["pd_served_model_name"],
    }


def run_testhosts(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return run([str(ROOT / "scripts" / "testhosts"), *args], timeout=timeout)


def host_cmd(host: str, command: str, timeout: int = 120, check: bool = True, ssh_attempts: int = 5) -> str:
    # ssh joins the remote words with spaces for the remote shell: pass the command as one word.
    argv = [str(ROOT / "scripts" / "testhosts"), "ssh", "--env", "local", host, "--", command]
    for _attempt in range(ssh_attempts - 1):
        # 255 is ssh's own failure: under load (engines restarting) sshd can miss the 5 s banner timeout.
        proc = run(argv, timeout=timeout, check=False)
        if proc.returncode != 255:
            break
        time.sleep(5)
    else:
        proc = run(argv, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc.stdout


def host_http_json(host: str, url: str) -> dict:
    """GET a JSON answer on `host` itself (Alertmanager listens on loopback there)."""
    return json.loads(host_cmd(host, shlex.join([
        "python3", "-c", "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read()"
                         ".decode())", url])))


def complete_through_router(inventory: dict, prompt: str = "Q: 3+4= A:", max_tokens: int = 4) -> dict:
    return http_json(f"{inventory['router_url']}/v1/completions",
                     {"model": inventory["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                     timeout=180)


@pytest.fixture(scope="session", autouse=True)
def stack(inventory):
    """Test hosts for the whole session; torn down at the end unless PD_KEEP_STACK=1."""
    t0 = time.monotonic()
    run_testhosts("up", "--env", "local")
    yield {"hosts_up_s": round(time.monotonic() - t0, 1)}
    if os.environ.get("PD_KEEP_STACK") != "1":
        run_testhosts("down", "--env", "local", timeout=300)


def test_site_brings_the_stack_up_and_verify_passes(stack, inventory):
    # pd_verify_report_dir: reports/<the inventory's directory name>.
    report_path = ROOT / "reports" / Path(INVENTORY).name / "verify-latest.json"
    report_path.unlink(missing_ok=True)  # a report of an earlier run is not this run's
    t0 = time.monotonic()
    proc = playbook("site.yml", timeout=2700)
    elapsed = round(time.monotonic() - t0, 1)
    failed = {h: r for h, r in recap(proc.stdout).items() if r.get("failed") or r.get("unreachable")}
    assert not failed, failed
    assert report_path.exists(), "verify wrote no report"
    report = json.loads(report_path.read_text())
    steps = report["steps"]
    record("site", {"testhosts_up_s": stack["hosts_up_s"], "site_s": elapsed, "verify_ok": report["ok"],
                    "failures": report["failures"],
                    "verify": {name: {k: v for k, v in step.items() if not isinstance(v, (list, dict))}
                               for name, step in steps.items()}})
    for step in ("readiness", "warmup", "kv_transfer", "accuracy"):
        assert steps[step]["ok"] and not steps[step].get("skipped"), (step, steps[step])


def test_prometheus_scrapes_every_target_and_has_per_pool_ttft(inventory):
    targets = http_json(f"{inventory['prometheus_url']}/api/v1/targets")["data"]["activeTargets"]
    down = [(t["labels"].get("job"), t["scrapeUrl"], t.get("lastError")) for t in targets if t["health"] != "up"]
    deadline = time.monotonic() + 90
    while down and time.monotonic() < deadline:  # a target scraped before its first interval reads "unknown"
        time.sleep(10)
        targets = http_json(f"{inventory['prometheus_url']}/api/v1/targets")["data"]["activeTargets"]
        down = [(t["labels"].get("job"), t["scrapeUrl"], t.get("lastError")) for t in targets if t["health"] != "up"]
    assert not down, down
    vllm_targets = {t["labels"].get("instance_name") for t in targets if t["labels"].get("job") == "vllm"}
    assert vllm_targets == {i["name"] for i in inventory["instances"]}
    query = "sum by (pool) (vllm:time_to_first_token_seconds_count)"
    url = f"{inventory['prometheus_url']}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    result = http_json(url)["data"]["result"]
    pools = sorted(r["metric"].get("pool") for r in result)
    record("prometheus", {"targets_up": len(targets), "jobs": sorted({t["labels"]["job"] for t in targets}),
                          "ttft_pools": pools})
    assert "prefill" in pools and "decode" in pools


def test_second_site_run_changes_nothing():
    # verify changes nothing and passed above; skipping it keeps this to the converging plays.
    t0 = time.monotonic()
    proc = playbook("site.yml", "--skip-tags", "verify", timeout=2400)
    changed = {h: r["changed"] for h, r in recap(proc.stdout).items() if r.get("changed")}
    record("idempotence", {"site_second_run_s": round(time.monotonic() - t0, 1), "changed": changed})
    assert not changed, f"second run changed something: {changed}"


def raw_request(url: str, method: str = "GET", headers: dict | None = None, body: bytes | None = None,
                timeout: float = 30) -> tuple[int, str]:
    """(status, body) of one request; connection errors raise."""
    req = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


# vllm-router's admin and internal paths (src/server.rs of 0.1.17): none may be reachable from a client address.
ROUTER_ADMIN = [("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers/http%3A%2F%2F10.0.0.1%3A1"),
                ("POST", "/add_worker?url=http://10.0.0.1:1"), ("POST", "/remove_worker?url=http://10.0.0.1:1"),
                ("GET", "/list_workers"), ("POST", "/flush_cache"), ("GET", "/get_loads"), ("GET", "/get_server_info"),
                ("GET", "/get_model_info"), ("GET", "/liveness"), ("GET", "/readiness"), ("GET", "/metrics")]


def test_front_door_refuses_clients_without_the_key_and_every_admin_path(inventory):
    url, key = inventory["router_url"], client_api_key()
    assert key, "no client key: scripts/bootstrap writes .cache/frontdoor/api-key"
    body = json.dumps({"model": inventory["model"], "prompt": "Q: 1+1= A:", "max_tokens": 2}).encode()
    ctype = {"Content-Type": "application/json"}
    refused = {}
    for name, headers in (("no key", ctype), ("wrong key", {**ctype, "Authorization": "Bearer " + "0" * 64}),
                          ("key without Bearer", {**ctype, "Authorization": key}),
                          ("basic auth", {**ctype, "Authorization": "Basic " + key})):
        refused[name] = raw_request(f"{url}/v1/completions", "POST", headers, body)[0]
    refused["models, no key"] = raw_request(f"{url}/v1/models")[0]
    admin = {f"{m} {p}": raw_request(url + p, m, {**ctype, "Authorization": f"Bearer {key}"},
                                     b"{}" if m == "POST" else None)[0] for m, p in ROUTER_ADMIN}
    # The routers themselves listen on loopback only: nothing answers on their ports from a client address.
    router_host = inventory["hostvars"][inventory["router_host"]]
    direct = {}
    for unit in router_host["pd_router_units"]:
        for port in (unit["port"],):
            try:
                direct[f"{unit['name']}:{port}"] = raw_request(f"http://{router_host['ansible_host']}:{port}/workers",
                                                               timeout=5)[0]
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                direct[f"{unit['name']}:{port}"] = f"unreachable ({getattr(e, 'reason', e)})"
    ok_status, ok_body = raw_request(f"{url}/v1/completions", "POST", {**ctype, "Authorization": f"Bearer {key}"},
                                     body, timeout=180)
    health = raw_request(f"{url}/health")[0]
    record("front-door-auth", {"refused": refused, "admin_paths": admin, "router_ports_from_client": direct,
                               "with_key": ok_status, "health_without_key": health})
    assert all(v == 401 for v in refused.values()), refused
    assert all(v == 404 for v in admin.values()), admin
    assert all(str(v).startswith("unreachable") for v in direct.values()), direct
    assert ok_status == 200 and json.loads(ok_body)["choices"], ok_body[:500]
    assert health == 200


def test_client_key_is_in_no_argv_log_or_world_readable_file(inventory):
    """On the router host: the key file nginx reads is root-only; no process argv, journal, log file or
    world-readable file holds any client key (the map holds each as a case-sensitive regex, its . and + escaped).
    The keys go to grep in a file (-f), never in its argv."""
    router = inventory["router_host"]
    keyfile = "/root/.pd-test-key"
    script = f"""set -eu
umask 077
sed -n 's/^"~^Bearer \\(.*\\)\\$" k[0-9a-f]\\{{8\\}};$/\\1/p' /etc/nginx/pd-frontdoor/api-keys.map \\
    | sed 's/\\\\\\(.\\)/\\1/g' > {keyfile}
test -s {keyfile}
echo "mode $(stat -c '%a %U:%G' /etc/nginx/pd-frontdoor/api-keys.map)"
argv=0
for f in /proc/[0-9]*/cmdline; do tr '\\000' ' ' < "$f" 2>/dev/null | grep -q -F -f {keyfile} && argv=$((argv+1)); done
echo "argv $argv"
echo "journal $(journalctl --no-pager -q 2>/dev/null | grep -c -F -f {keyfile} || true)"
echo "logs $(grep -r -l -F -f {keyfile} /var/log 2>/dev/null | wc -l)"
echo "world-readable $(find /etc /opt /srv /var /home /root /tmp /run -xdev -type f -perm -o+r -size -20M \
    -exec grep -l -F -f {keyfile} {{}} + 2>/dev/null | wc -l)"
rm -f {keyfile}
"""
    out = host_cmd(router, script)
    found = dict(line.split(" ", 1) for line in out.strip().splitlines())
    record("front-door-key-exposure", found)
    assert found["mode"] == "600 root:root", found
    assert found["argv"] == "0" and found["journal"] == "0" and found["logs"] == "0", found
    assert found["world-readable"] == "0", found


def frontdoor_paths(router: str) -> dict:
    """Requests the front door has served, by path (pd | colocated | none), from its mtail metrics."""
    text = host_cmd(router, "curl -sf http://127.0.0.1:3903/metrics")
    out: dict = {}
    for name, labels, value in parse_prometheus(text):
        if name == "pd_frontdoor_requests_total":
            out[labels.get("path", "?")] = out.get(labels.get("path", "?"), 0) + value
    return out


def nixl_transfers(inst: dict, router: str) -> float:
    """KV transfers an instance has pulled over NIXL (vllm:nixl_xfer_time_seconds_count on its /metrics, read from
    the router host as Prometheus does)."""
    text = host_cmd(router, f"curl -sf {inst['url']}/metrics")
    return metric_sum(parse_prometheus(text), "vllm:nixl_xfer_time_seconds_count") or 0.0


def test_decode_kill_under_load_fails_no_request(inventory):
    """kill -9 of the first decode engine under steady load through the front door: 0 failed requests. The only
    decode instance: served colocated within 10 s, P/D again once systemd has restarted it. With another decode
    instance: P/D throughout (no request on the colocated path, the other decode pulls KV over NIXL meanwhile)."""
    decodes = [i for i in inventory["instances"] if i["pool"] == "decode"]
    decode, others = decodes[0], decodes[1:]
    unit = f"vllm-{decode['name']}.service"
    router = inventory["router_host"]

    def nrestarts() -> int:
        return int(host_cmd(decode["host"], f"systemctl show -p NRestarts --value {unit}").strip())

    before = nrestarts()
    gen = LoadGenerator(url=inventory["router_url"], model=inventory["model"], api_key=client_api_key(),
                        **STEADY_LOAD)
    gen.start()
    try:
        # Before the kill the stack serves P/D (so "colocated after the kill" is the fault's doing): requests
        # completed on the P/D path, none on the backup path, for at least 15 s.
        warm, t_warm = frontdoor_paths(router), time.monotonic()
        while True:
            time.sleep(5)
            paths0 = frontdoor_paths(router)
            assert paths0.get("colocated", 0) == warm.get("colocated", 0), ("colocated before the kill", warm, paths0)
            if paths0.get("pd", 0) > warm.get("pd", 0) and time.monotonic() - t_warm >= 15:
                break
            assert time.monotonic() - t_warm < 180, ("no P/D completion in 180 s before the kill", warm, paths0)
        pid = host_cmd(decode["host"], f"systemctl show -p MainPID --value {unit}").strip()
        assert pid not in ("", "0"), f"{unit} has no main process"
        xfers0 = {o["name"]: nixl_transfers(o, router) for o in others}
        host_cmd(decode["host"], f"kill -9 {pid}")
        t0 = time.monotonic()
        colocated_s = None
        while not others and colocated_s is None and time.monotonic() - t0 < 60:
            if frontdoor_paths(router).get("colocated", 0) > paths0.get("colocated", 0):
                colocated_s = round(time.monotonic() - t0, 1)
            else:
                time.sleep(1)
        restarted_s = pd_again_s = None
        xfers_outage = None
        while time.monotonic() - t0 < 600:
            if restarted_s is None and nrestarts() > before:
                restarted_s = round(time.monotonic() - t0, 1)
                # What the other decode instances pulled while this one was down (up to its restart).
                xfers_outage = {o["name"]: nixl_transfers(o, router) - xfers0[o["name"]] for o in others}
            if restarted_s is not None:
                p1 = frontdoor_paths(router).get("pd", 0)
                time.sleep(5)
                if frontdoor_paths(router).get("pd", 0) > p1:
                    pd_again_s = round(time.monotonic() - t0, 1)
                    break
            else:
                time.sleep(3)
        time.sleep(10)
    finally:
        load = gen.stop()
    paths1 = frontdoor_paths(router)
    record("kill-decode", {"decode_instances": [d["name"] for d in decodes], "colocated_after_s": colocated_s,
                           "restarted_after_s": restarted_s, "pd_again_after_s": pd_again_s,
                           "other_decodes_nixl_transfers_during_outage": xfers_outage,
                           "paths_before": paths0, "paths_after": paths1,
                           "load": {k: load.get(k) for k in ("sent", "completed", "failed", "failures",
                                                             "error_samples", "longest_completion_gap_s")}})
    assert load["failed"] == 0 and load["completed"] > 0, (load["failures"], load["error_samples"])
    if others:
        assert paths1.get("colocated", 0) == paths0.get("colocated", 0), ("served colocated", paths0, paths1)
        assert xfers_outage and all(v > 0 for v in xfers_outage.values()), ("no KV pulled meanwhile", xfers_outage)
    else:
        assert colocated_s is not None and colocated_s <= 10, f"served colocated after {colocated_s} s (limit 10 s)"
    assert restarted_s is not None, f"{unit} was not restarted within 600 s"
    assert pd_again_s is not None, "P/D did not resume within 600 s of the kill"


RUNNING_PY = r"""
import glob, json, os, subprocess
# What each vLLM instance of this host runs: the model revision on its main process's command line (ground
# truth), and what its records say (the record, or the saved previous one while a restart is pending).
out = {}
for path in glob.glob("/etc/vllm/*.record.json"):
    name = os.path.basename(path)[: -len(".record.json")]
    pending = os.path.exists(f"/etc/vllm/.{name}.restart-pending")
    try:
        rec = json.load(open(f"/etc/vllm/rollback/{name}.record.json" if pending else path))
    except (OSError, ValueError):
        rec = {}
    pid = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", f"vllm-{name}.service"],
                         capture_output=True, text=True).stdout.strip()
    try:
        argv = open(f"/proc/{pid}/cmdline").read().split("\0") if pid not in ("", "0") else []
    except OSError:
        argv = []
    model = next((a for a in argv if "/revisions/" in a), None)
    out[name] = {"pid": pid, "process_revision": model.rstrip("/").rsplit("/", 1)[-1] if model else None,
                 "record_revision": rec.get("model_revision"), "pending": pending}
print(json.dumps(out))
"""


def running_revisions(inventory: dict) -> dict:
    """{instance: {pid, process_revision, record_revision, pending}} over every vLLM host."""
    out = {}
    for host in sorted({i["host"] for i in inventory["instances"]}):
        text = host_cmd(host, f"python3 -c {shlex.quote(RUNNING_PY)}", timeout=60, check=False)
        try:
            out.update(json.loads(text.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            pass  # a missed sample (ssh under load); the next one counts
    return out


def router_registries(inventory: dict) -> list[list[dict]]:
    router = inventory["router_host"]
    regs = []
    for unit in inventory["hostvars"][router]["pd_router_units"]:
        if unit["mode"] != "pd":
            continue
        text = host_cmd(router, "/opt/vllm-router/current/bin/python /opt/vllm-router/bin/pd-router-workers"
                                f" --router http://127.0.0.1:{unit['port']} list", check=False)
        try:
            regs.append(json.loads(text)["workers"])
        except (ValueError, KeyError):
            pass
    return regs


class PairWatch(threading.Thread):
    """While a change runs: every few seconds, which prefill and decode workers each P/D router pairs and which
    model revision each of those processes runs. A P/D pair across two revisions is a violation."""

    def __init__(self, inventory: dict):
        super().__init__(daemon=True)
        self.inventory, self.stop_event = inventory, threading.Event()
        self.samples, self.violations = 0, []
        self.url_to_name = {i["url"]: i["name"] for i in inventory["instances"]}

    def run(self):
        while not self.stop_event.is_set():
            revs = running_revisions(self.inventory)
            for reg in router_registries(self.inventory):
                paired = {self.url_to_name.get(w["url"], w["url"]): w["worker_type"] for w in reg
                          if w["worker_type"] in ("prefill", "decode")}
                seen = {revs.get(n, {}).get("process_revision") for n in paired}
                if len(seen - {None}) > 1 and {"prefill", "decode"} <= set(paired.values()):
                    self.violations.append({"paired": paired, "revisions": revs})
            self.samples += 1
            self.stop_event.wait(4)

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(timeout=120)
        return {"samples": self.samples, "violations": self.violations[:3]}


def wait_until_routed(inventory: dict, bound_s: float, what: str) -> None:
    """Wait until a completion through the front door succeeds (a previous test restarted or switched instances)."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            if complete_through_router(inventory).get("choices"):
                return
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError):
            pass
        assert time.monotonic() < deadline, f"{what}: the front door did not route a completion within {bound_s} s"
        time.sleep(3)


def change_through_site(inventory: dict, name: str, extra: dict | None) -> dict:
    """site.yml (verify skipped) with `extra` under steady load through the front door; figures of the run."""
    wait_until_routed(inventory, 300, f"{name}, before the change")  # the load starts on a stack that routes
    before_reports = set(REPORTS.parent.glob("change-*.json"))
    revs_before = running_revisions(inventory)
    paths_before = frontdoor_paths(inventory["router_host"])
    gen = LoadGenerator(url=inventory["router_url"], model=inventory["model"], api_key=client_api_key(),
                        **STEADY_LOAD)
    watch = PairWatch(inventory)
    gen.start()
    watch.start()
    t1 = time.monotonic()
    try:
        args = [str(VENV_BIN / "ansible-playbook"), "-i", INVENTORY, "site.yml", "--skip-tags", "verify"]
        if extra:
            args += ["-e", json.dumps(extra)]
        proc = run(args, timeout=3000, check=False)
    finally:
        load = gen.stop()
        pairs = watch.stop()
    took = round(time.monotonic() - t1, 1)
    REPORTS.mkdir(parents=True, exist_ok=True)  # also when this test runs alone (-k)
    (REPORTS / f"{name}.log").write_text(proc.stdout + proc.stderr)  # profile_tasks timings for review
    new_reports = sorted(set(REPORTS.parent.glob("change-*.json")) - before_reports)
    instances = json.loads(new_reports[-1].read_text())["instances"] if new_reports else []
    revs_after = running_revisions(inventory)
    paths_after = frontdoor_paths(inventory["router_host"])
    figures = {
        "site_s": took, "extra": extra,
        # Requests the front door served during the change, by path (its mtail counters: pd | colocated | none).
        "paths_during": {k: paths_after.get(k, 0) - paths_before.get(k, 0) for k in sorted({*paths_before,
                                                                                            *paths_after})},
        "load": {k: load.get(k) for k in ("sent", "completed", "failed", "failures", "error_samples",
                                          "latency_s", "longest_completion_gap_s")},
        "pair_watch": pairs, "revisions_before": revs_before, "revisions_after": revs_after,
        "instances": instances}
    record(name, figures)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert load["completed"] > 0 and load["failed"] == 0, (load["failures"], load["error_samples"])
    assert pairs["samples"] > 0 and not pairs["violations"], pairs
    # records and processes agree, and nothing is left pending
    for name_, r in revs_after.items():
        assert r["process_revision"] == r["record_revision"] and not r["pending"], (name_, r)
    router = inventory["router_host"]
    for reg in router_registries(inventory):
        assert sorted({w["worker_type"] for w in reg}) == ["decode", "prefill"], (router, reg)
    # each restarted instance's own alerts were silenced for its restart, and the silence is over now that it is back
    am = cluster()[0]["alertmanager"]
    for inst in instances:
        assert inst.get("alert_silence"), f"{inst['instance']} restarted without an Alertmanager silence: {inst}"
        silence = host_http_json(am["host"], f"{am['url']}/api/v2/silence/{inst['alert_silence']}")
        assert silence["status"]["state"] == "expired", silence
        assert {m["name"]: m["value"] for m in silence["matchers"]} == {
            "instance_name": inst["instance"], "host": inst["host"]}, silence
    return figures


def _decode_only_flags(inventory: dict) -> dict:
    first_vllm = inventory["instances"][0]["host"]
    pool = json.loads(json.dumps(inventory["hostvars"][first_vllm]["pd_vllm_flags_pool"]))
    pool["decode"]["max-num-seqs"] = 8 if pool["decode"].get("max-num-seqs") != 8 else 16
    return pool


def _revisions() -> tuple[str, str]:
    src = ROOT / ".cache" / "model-src"
    return (src / "tiny-pd.REVISION").read_text().strip(), (src / "tiny-pd-r2.REVISION").read_text().strip()


@pytest.mark.change_full
def test_change_path_flag_change_restarts_only_the_decode_instance(inventory):
    """(a) A decode-pool flag through plain site.yml: only the decode instances restart, one at a time, drain first,
    0 failed requests, P/D at the end (issue #15). The only decode instance is served colocated meanwhile; one of
    several P/D through the others, and then no request at all takes the colocated path (issue #34)."""
    decode = [i["name"] for i in inventory["instances"] if i["pool"] == "decode"]
    a = change_through_site(inventory, "change-flag", {"pd_vllm_flags_pool": _decode_only_flags(inventory)})
    assert sorted(i["instance"] for i in a["instances"]) == decode, a["instances"]
    meanwhile = "colocated" if len(decode) == 1 else "pd"
    assert all(i["served_meanwhile"] == meanwhile for i in a["instances"]), a["instances"]
    assert a["paths_during"].get("pd", 0) > 0, a["paths_during"]
    if len(decode) > 1:
        assert a["paths_during"].get("colocated", 0) == 0, ("P/D throughout", a["paths_during"])
    for name, before in a["revisions_before"].items():
        if name not in decode:
            assert a["revisions_after"][name]["pid"] == before["pid"], f"{name} restarted"


@pytest.mark.upgrade
def test_change_path_revision_switch_through_site_yml_drops_no_request(inventory):
    """(b) A second revision of the tiny model through site.yml: every instance restarts drain first, prefill first,
    decode last, 0 failed requests, no P/D pair across two revisions at any sample (the routers' registries against
    the revision on each process's command line), records and processes agree, P/D at the end (issue #15).
    The first decode instance to restart is served colocated meanwhile (no decode instance of the new revision is
    left to pair with: the fallback of the last decode instance, live on either inventory); every later one P/D,
    through the decode instances already on the new revision (issue #34)."""
    _r1, r2 = _revisions()
    names = sorted(i["name"] for i in inventory["instances"])
    decode = [i["name"] for i in inventory["instances"] if i["pool"] == "decode"]
    source = {"type": "path", "path": "/srv/model-src/tiny-pd-r2", "revision": r2}
    b = change_through_site(inventory, "change-revision", {"pd_model_source": source})
    assert sorted(i["instance"] for i in b["instances"]) == names, b["instances"]
    pools = [i["pool"] for i in b["instances"]]
    assert pools == sorted(pools, key=lambda p: p != "prefill"), ("prefill first, decode last", b["instances"])
    meanwhile = [i["served_meanwhile"] for i in b["instances"] if i["pool"] == "decode"]
    assert meanwhile == ["colocated"] + ["pd"] * (len(decode) - 1), b["instances"]
    assert {r["process_revision"] for r in b["revisions_after"].values()} == {r2}, b["revisions_after"]


@pytest.mark.change_full
def test_change_path_rollback_to_the_inventory_as_it_was(inventory):
    """(c) The rollback: site.yml with the inventory as committed (revision r1, still on disk; the original flags),
    the same drain path, 0 failed requests (issue #15)."""
    r1, _r2 = _revisions()
    c = change_through_site(inventory, "change-rollback", None)
    assert c["instances"], "nothing was rolled back"
    assert {r["process_revision"] for r in c["revisions_after"].values()} == {r1}, c["revisions_after"]
