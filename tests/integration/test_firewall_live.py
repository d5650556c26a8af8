"""Issue 32, the per-service port matrix on the live embedded default: real TCP connections between the test hosts.

Run on the live stack after site.yml (test_local_stack.py's, left up with PD_KEEP_STACK=1):

    .venv/bin/pytest -q -p no:cacheprovider tests/integration/test_firewall_live.py

Each host probes the others' listening ports with a 1.5 s connect (python3 on the host): "open" = connected,
"refused" = the host answered with a reset (the firewall let the SYN through, nothing listens), "dropped" = no
answer (the default-deny ruleset dropped it). The embedded default puts the routers and monitoring on pd-router-0:
- from the prefill host: the router host's front door, router metrics, mtail, node exporter and Prometheus are
  dropped; so are the decode instance's vLLM HTTP and DP ports (vLLM HTTP is for routers and monitoring only);
- from the router/monitoring host: every instance's vLLM HTTP and the vLLM hosts' node exporters are open, the
  prefill's NIXL side channel is dropped;
- from the decode host: the prefill's NIXL side channel (the pull of the KV blocks) is open, its vLLM HTTP dropped.
The tests/unit netns test shows the same matrix for the b300 rulesets.
A firewall change whose play is killed between writing the ruleset and loading it is loaded by the next run.
A vLLM process (the vLLM user) is refused at once, by its own host, every service port that is not vLLM's own
(the routers and their admin API, the front door, Prometheus, the exporters), and still reaches vLLM's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from urllib.parse import urlsplit

from test_local_stack import ENV, INVENTORY, ROOT, VENV_BIN, cluster, host_cmd, playbook, record
from test_local_stack import inventory as _inventory_fixture

inventory = _inventory_fixture  # the session fixture of test_local_stack.py

PROBE = r"""
import errno, json, socket, sys
out = {}
for target in json.loads(sys.argv[1]):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.5).close()
        out[target] = "open"
    except socket.timeout:
        out[target] = "dropped"
    except OSError as e:
        dropped = e.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH)
        out[target] = "refused" if e.errno == errno.ECONNREFUSED else "dropped" if dropped else str(e)
print(json.dumps(out))
"""


def probe(host: str, targets: list[str], user: str = "") -> dict:
    as_user = f"runuser -u {user} -- " if user else ""
    script = f"{as_user}python3 -c '{PROBE}' '{json.dumps(targets)}'"
    return json.loads(host_cmd(host, script, timeout=120).strip().splitlines()[-1])


def node_exporter_port(view: dict, host: str) -> int:
    """The host's node exporter port, as Prometheus scrapes it (the cluster view's targets)."""
    target = next(t["target"] for t in view["prometheus_targets"]["node"] if t["labels"]["host"] == host)
    return int(target.rsplit(":", 1)[1])


def router_host_ports(view: dict, router: str) -> list[int]:
    """The router/monitoring host's ports other than the router units': the front door, its metrics (mtail),
    Prometheus and the node exporter, all from the cluster view."""
    r = next(r for r in view["routers"] if r["host"] == router)
    return sorted({r["client_port"], r["frontdoor_metrics_port"], urlsplit(view["prometheus_url"]).port,
                   node_exporter_port(view, router)})


def _stack(inventory):
    """(the first prefill instance, the first decode instance, the router host, its address)."""
    by_pool = {}
    for inst in inventory["instances"]:
        by_pool.setdefault(inst["pool"], []).append(inst)
    router = inventory["router_host"]
    return by_pool["prefill"][0], by_pool["decode"][0], router, inventory["hostvars"][router]["ansible_host"]


def test_each_service_is_reachable_only_from_the_hosts_that_need_it(inventory):
    hv = inventory["hostvars"]
    view = cluster()[0]
    prefill, decode, router, r_addr = _stack(inventory)
    p_addr, d_addr = prefill["address"], decode["address"]
    router_metrics = [u["metrics_port"] for u in hv[router]["pd_router_units"]]
    expect = {
        prefill["host"]: {
            **{f"{r_addr}:{p}": "dropped" for p in [*router_host_ports(view, router), *router_metrics]},
            f"{d_addr}:{decode['http_port']}": "dropped",
        },
        router: {
            **{f"{i['address']}:{i['http_port']}": "open" for i in inventory["instances"]},
            f"{p_addr}:{node_exporter_port(view, prefill['host'])}": "open",
            f"{d_addr}:{node_exporter_port(view, decode['host'])}": "open",
            f"{p_addr}:{prefill['nixl_side_channel_port']}": "dropped",
        },
        decode["host"]: {
            f"{p_addr}:{prefill['nixl_side_channel_port']}": "open",
            f"{p_addr}:{prefill['http_port']}": "dropped",
        },
    }
    found = {host: probe(host, sorted(targets)) for host, targets in expect.items()}
    record("firewall-matrix-live", {"expected": expect, "found": found})
    wrong = {host: {t: (want, found[host].get(t)) for t, want in targets.items() if found[host].get(t) != want}
             for host, targets in expect.items()}
    assert not any(wrong.values()), wrong


def test_a_vllm_process_reaches_only_vllm_services(inventory):
    hv = inventory["hostvars"]
    view = cluster()[0]
    prefill, decode, router, r_addr = _stack(inventory)
    user = hv[decode["host"]].get("pd_vllm_user", "vllm")
    unit_ports = [p for u in hv[router]["pd_router_units"] for p in (u["port"], u["metrics_port"])]
    refused = [f"{r_addr}:{p}" for p in [*router_host_ports(view, router), *unit_ports]] + [
        f"{prefill['address']}:{node_exporter_port(view, prefill['host'])}"]
    own = f"{prefill['address']}:{prefill['nixl_side_channel_port']}"
    found = probe(decode["host"], sorted([*refused, own]), user=user)
    as_root = probe(decode["host"], sorted(refused))
    record("firewall-vllm-egress-live", {"user": user, "found": found, "as_root": as_root})
    # refused by the decode host itself (a reset at once); root's SYNs go out and the router host drops them
    assert {t: found[t] for t in refused} == dict.fromkeys(refused, "refused"), found
    assert set(as_root.values()) == {"dropped"}, as_root
    assert found[own] == "open", found


KILL_AFTER = "TASK [b300.pd.pd_firewall : Write the first-install fallback"  # the task after "Write the ruleset"


def _firewall_play(host: str, peers: list[str]) -> list[str]:
    """deploy.yml's firewall play alone on host, with these extra peers (ansible-playbook's arguments)."""
    return ["playbooks/deploy.yml", "--tags", "firewall", "--limit", host,
            "-e", json.dumps({"pd_firewall_extra_peers": peers})]


def _firewall_state(host: str, marker: str) -> dict:
    """Whether marker (an address) is in the written ruleset file and in the loaded table."""
    out = host_cmd(host, f"grep -c '{marker}' /etc/nftables.d/pd-firewall.nft; "
                         f"nft list table inet pd_firewall | grep -c '{marker}'; true", timeout=60)
    written, loaded = (int(n) for n in out.split()[-2:])
    return {"written": written > 0, "loaded": loaded > 0}


def test_an_interrupted_firewall_change_is_loaded_by_the_next_run(inventory):
    host = next(i["host"] for i in inventory["instances"] if i["pool"] == "prefill")
    peers = list(inventory["hostvars"][host]["pd_firewall_extra_peers"])
    marker = "203.0.113.9"
    assert _firewall_state(host, marker) == {"written": False, "loaded": False}
    # The change (one more extra peer), killed (SIGKILL, the whole process group) once the ruleset is written.
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", INVENTORY, *_firewall_play(host, [*peers, marker])]
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen, deadline = [], time.monotonic() + 600
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(KILL_AFTER) or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert seen and seen[-1].startswith(KILL_AFTER), "".join(seen[-40:])
    interrupted = _firewall_state(host, marker)
    # The next run, which writes nothing new (the file is already what it renders), loads it.
    playbook(*_firewall_play(host, [*peers, marker]), timeout=600)
    loaded = _firewall_state(host, marker)
    # Back to the inventory's ruleset.
    playbook(*_firewall_play(host, peers), timeout=600)
    restored = _firewall_state(host, marker)
    record("firewall-interrupted-change", {"host": host, "interrupted": interrupted, "after_rerun": loaded,
                                           "restored": restored})
    assert interrupted == {"written": True, "loaded": False}, interrupted
    assert loaded == {"written": True, "loaded": True}, loaded
    assert restored == {"written": False, "loaded": False}, restored
