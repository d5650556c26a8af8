"""The cluster view (plugins/module_utils/pd_cluster_view.py cluster_view, published as pd_cluster by
playbooks/validate.yml and loaded by bench/pd_cluster.py): on both real inventories it holds exactly what main's
roles rendered from hostvars
(values below were taken from main's rendered prometheus.yml, router units, rulesets and verify defaults)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
from ansible_collections.b300.pd.bench.pd_cluster import load  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_view import TopologyError, cluster_view  # noqa: E402


@functools.cache
def view(name):
    return load(ROOT / "inventory" / name)


def test_local_instances_router_and_prometheus():
    v = view("local")
    assert [(i["name"], i["host"], i["pool"], i["url"]) for i in v["instances"]] == [
        ("prefill-0", "pd-prefill-0", "prefill", "http://10.237.0.11:8100"),
        ("prefill-1", "pd-prefill-0", "prefill", "http://10.237.0.11:8101"),
        ("decode-0", "pd-decode-0", "decode", "http://10.237.0.12:8200")]
    assert v["pools"] == {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0"]}
    assert v["router_url"] == "http://10.237.0.13:8000"
    # inventory/local opts out of TLS (pd_frontdoor_tls_enabled: false, pd_frontdoor_allow_plain_http): no CA.
    assert v["router_ca_file"] is None and v["routers"][0]["scheme"] == "http"
    assert v["prometheus_url"] == "http://10.237.0.13:9090"
    # Alertmanager listens on loopback (the role's default): its API as the monitoring host itself reaches it
    assert v["alertmanager"] == {"host": "pd-router-0", "url": "http://127.0.0.1:9093"}
    # pd_rollout's registry tool runs on the first router host: its own P/D units on loopback.
    assert v["pd_router_urls"] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_local_prometheus_targets_are_mains():
    t = view("local")["prometheus_targets"]
    assert [(x["target"], x["labels"]) for x in t["vllm"]] == [
        ("10.237.0.11:8100", {"pool": "prefill", "instance_name": "prefill-0", "host": "pd-prefill-0"}),
        ("10.237.0.11:8101", {"pool": "prefill", "instance_name": "prefill-1", "host": "pd-prefill-0"}),
        ("10.237.0.12:8200", {"pool": "decode", "instance_name": "decode-0", "host": "pd-decode-0"})]
    assert [(x["target"], x["labels"]["router_unit"], x["labels"]["router_mode"]) for x in t["pd-router"]] == [
        ("10.237.0.13:29000", "vllm-router", "pd"), ("10.237.0.13:29001", "vllm-router-2", "pd"),
        ("10.237.0.13:29009", "vllm-router-colocated", "colocated")]
    assert [x["target"] for x in t["pd-frontdoor"]] == ["10.237.0.13:3903"]
    assert [(x["target"], x["labels"]["vllm_host"]) for x in t["node"]] == [
        ("10.237.0.11:9100", "true"), ("10.237.0.12:9100", "true"), ("10.237.0.13:9100", "false")]


def test_local_firewall_sets_are_mains():
    fw = view("local")["firewall"]
    assert fw["peers"] == ["10.237.0.11", "10.237.0.12", "10.237.0.13"]
    assert fw["hosts"]["pd-prefill-0"] == {"instance_ports": [5600, 5610, 8100, 8101], "router_ports": [],
                                           "client_ports": []}
    assert fw["hosts"]["pd-decode-0"]["instance_ports"] == [5700, 8200]
    assert fw["hosts"]["pd-router-0"] == {"instance_ports": [], "client_ports": [8000],
                                          "router_ports": [3903, 8001, 8002, 8009, 29000, 29001, 29009]}


def test_b300_view_is_mains():
    v = view("b300")
    assert [i["url"] for i in v["instances"]] == [
        "http://192.0.2.11:8100", "http://192.0.2.11:8101", "http://192.0.2.12:8100", "http://192.0.2.12:8101",
        "http://192.0.2.13:8200"]
    # TLS by default (issue #32): the front doors answer https, clients trust the bundle's CA on the control node.
    assert v["router_url"] == "https://192.0.2.13:8000"  # router_hosts[0] is b300-03
    assert [(r["url"], r["scheme"]) for r in v["routers"]] == [
        ("https://192.0.2.13:8000", "https"), ("https://192.0.2.12:8000", "https")]
    assert Path(v["router_ca_file"]).resolve() == ROOT / ".cache" / "tls" / "ca.crt"
    assert v["prometheus_url"] == "http://192.0.2.13:9090"
    assert v["pd_router_urls"] == ["http://127.0.0.1:8001", "http://192.0.2.12:8001"]
    # The loopback URL is the registry host's own router: the change path's registry tool and the dead-worker
    # watcher run there, one value for both (pd_rollout_router_host, pd_router_watch_host).
    assert v["registry_host"] == "b300-03"
    fw = v["firewall"]["hosts"]
    assert fw["b300-01"]["instance_ports"] == [5600, 5601, 5602, 5603, 5610, 5611, 5612, 5613, 8100, 8101, 13345,
                                               13355]
    assert fw["b300-03"] == {"instance_ports": [5700, 5701, 5702, 5703, 5704, 5705, 5706, 5707, 8200, 13345],
                             "router_ports": [3903, 8001, 8009, 29000, 29009], "client_ports": [8000]}
    t = v["prometheus_targets"]
    assert [x["target"] for x in t["dcgm"]] == ["192.0.2.11:9400", "192.0.2.12:9400", "192.0.2.13:9400"]
    assert [x["labels"]["host"] for x in t["pd-frontdoor"]] == ["b300-03", "b300-02"]
    assert [x["target"] for x in t["node"]] == ["192.0.2.11:9100", "192.0.2.12:9100", "192.0.2.13:9100"]


def _hosts():
    return {"h1": {"ansible_host": "10.0.0.1", "node_exporter_port": 9100, "pd_instances": [
        {"name": "p", "pool": "prefill", "http_port": 8100, "nixl_side_channel_port": 5600, "dp_size": 2,
         "dp_rpc_port": 13345},
        {"name": "d", "pool": "decode", "http_port": 8200, "nixl_side_channel_port": 5700}]}}


def _router(**over):
    r = {"host": "r1", "address": "10.0.0.9", "client_port": 8000, "bind_host": "127.0.0.1",
         "frontdoor_metrics_port": 3903, "node_exporter_port": 9100,
         "units": [{"name": "vllm-router", "mode": "pd", "port": 8001, "metrics_port": 29000}]}
    r.update(over)
    return r


def test_side_channel_range_and_dp_rpc_port_are_opened():
    v = cluster_view(_hosts(), [_router()], [], ["10.0.0.1", "10.0.0.9"])
    assert v["instances"][0]["nixl_side_channel_ports"] == [5600, 5601]
    assert v["firewall"]["hosts"]["h1"]["instance_ports"] == [5600, 5601, 5700, 8100, 8200, 13345]
    assert v["prometheus_url"] is None and v["alertmanager"] is None
    assert v["router_url"] == "http://10.0.0.9:8000"


@pytest.mark.parametrize(("router", "named"), [
    (_router(units=[{"name": "vllm-router-c", "mode": "colocated", "port": 8009, "metrics_port": 29009}]),
     "router host r1, field pd_router_units: no unit with mode: pd"),
    (_router(units=[{"name": "vllm-router", "mode": "both", "port": 8001, "metrics_port": 29000}]),
     "router host r1, field pd_router_units[0].mode: 'both' is not a mode"),
    (_router(units=[{"name": "vllm-router", "mode": "pd", "port": "80x", "metrics_port": 29000}]),
     "router host r1, field pd_router_units[0].port: '80x' is not a port the unprivileged router can listen on"),
    # the router units run unprivileged: a port below 1024 would fail only at start, on the host
    (_router(units=[{"name": "vllm-router", "mode": "pd", "port": 80, "metrics_port": 29000}]),
     "field pd_router_units[0].port: 80 is not a port the unprivileged router can listen on; use an integer in "
     "1024..65535"),
    (_router(units=[{"name": "vllm-router", "mode": "pd", "port": 8001, "metrics_port": 70000}]),
     "field pd_router_units[0].metrics_port: 70000 is not a port"),
    (_router(units=None), "router host r1, field pd_router_units: missing or empty"),
])
def test_bad_router_input_is_named(router, named):
    with pytest.raises(TopologyError) as exc:
        cluster_view(_hosts(), [router], [], [])
    assert named in str(exc.value)


@pytest.mark.parametrize(("listen", "url"), [
    ("127.0.0.1", "http://127.0.0.1:9093"),  # the role's default: only its own host reaches the API
    ("0.0.0.0", "http://127.0.0.1:9093"),  # noqa: S104 (every address, loopback too)
    (None, "http://127.0.0.1:9093"),
    ("10.0.0.9", "http://10.0.0.9:9093"),  # one address only: not on loopback
])
def test_alertmanager_api_as_its_own_host_reaches_it(listen, url):
    mon = {"host": "m1", "address": "10.0.0.9", "prometheus_port": 9090, "alertmanager_port": "9093",
           "alertmanager_listen_address": listen, "dcgm_exporter_port": 9400}
    v = cluster_view(_hosts(), [_router()], [mon], ["10.0.0.1", "10.0.0.9"])
    assert v["alertmanager"] == {"host": "m1", "url": url}
    assert v["prometheus_url"] == "http://10.0.0.9:9090"
    assert cluster_view(_hosts(), [_router()], [dict(mon, alertmanager_port=None)], [])["alertmanager"] is None


def _published_view(inventory: Path, tmp_path: Path) -> dict:
    """pd_cluster as playbooks/validate.yml publishes it for `inventory` (read from the run's JSON output)."""
    # stdout is the JSON callback's alone: ansible.cfg's profile_tasks (timings on stdout) gives way to junit, which
    # writes only its report file.
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.posix.json",
               ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.junit", JUNIT_OUTPUT_DIR=str(tmp_path / "junit"),
               ANSIBLE_NOCOLOR="1")
    proc = subprocess.run(  # noqa: S603 - the repo's own ansible-playbook
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory),
         str(ROOT / "playbooks" / "validate.yml"), "--skip-tags", "frontdoor,known_hosts",
         "-e", "pd_control_vllm_python=none",
         # The workers' key (validate refuses a deploy without one; the copied inventory has no .cache beside it).
         "-e", "pd_router_api_key=" + "0" * 64],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    tasks = [t for play in json.loads(proc.stdout)["plays"] for t in play["tasks"]]
    publish = next(t for t in tasks if t["task"]["name"] == "Publish the cluster view to every host as pd_cluster")
    host_results = next(iter(publish["hosts"].values()))["results"]
    return next(r["ansible_facts"]["pd_cluster"] for r in host_results if r["item"] == "localhost")


def test_playbook_and_bench_compose_the_same_view_of_every_view_var(tmp_path):
    """One list of the vars the view reads (VIEW_VARS): an inventory that sets the one validate.yml's own copy had
    lost (observability_alertmanager_listen_address) gets the same view through the playbook as through bench."""
    inventory = tmp_path / "local"
    shutil.copytree(ROOT / "inventory" / "local", inventory)
    (inventory / "host_vars" / "pd-router-0.yml").write_text(
        yaml.safe_dump({"observability_alertmanager_listen_address": "10.237.0.13"}))
    bench_view = load(inventory)
    assert bench_view["alertmanager"] == {"host": "pd-router-0", "url": "http://10.237.0.13:9093"}
    assert _published_view(inventory, tmp_path) == bench_view


def test_firewall_matrix_per_service():
    """Issue 32: each service port of each host lists the hosts that need it (pd_topology_ports.firewall_matrix)."""
    prefill = {"name": "p", "pool": "prefill", "http_port": 8100, "nixl_side_channel_port": 5600, "dp_size": 2,
               "dp_rpc_port": 13345}
    decode = {"name": "d", "pool": "decode", "http_port": 8200, "nixl_side_channel_port": 5700}
    hosts = {"p1": {"ansible_host": "10.0.0.1", "node_exporter_port": 9100, "pd_instances": [prefill]},
             "d1": {"ansible_host": "10.0.0.2", "node_exporter_port": 9100, "pd_instances": [decode]}}
    mon = {"host": "m1", "address": "10.0.0.8", "prometheus_port": 9090, "alertmanager_port": 9093,
           "alertmanager_listen_address": "127.0.0.1", "dcgm_exporter_port": 9400, "node_exporter_port": 9100}
    peers = {h: {"ansible_host": a, "pd_firewall_host_addresses": x} for h, a, x in [
        ("p1", "10.0.0.1", ["fd00::1"]), ("d1", "10.0.0.2", None), ("r1", "10.0.0.9", []), ("m1", "10.0.0.8", [])]}
    fw = cluster_view(hosts, [_router()], [mon], peers)["firewall"]
    rules = {h: {r["service"]: (r["ports"], r["sources"]) for r in rs} for h, rs in fw["rules"].items()}
    assert rules["p1"] == {"vllm_http": ([8100], ["10.0.0.8", "10.0.0.9"]),
                           "nixl_side_channel_prefill": ([5600, 5601], ["10.0.0.2"]),
                           "dp_rpc": ([13345], ["10.0.0.1", "10.0.0.2", "fd00::1"]),
                           "dcgm_exporter": ([9400], ["10.0.0.8"]), "node_exporter": ([9100], ["10.0.0.8"])}
    assert rules["d1"]["nixl_side_channel_decode"] == ([5700], ["10.0.0.1", "fd00::1"])
    assert rules["r1"] == {"router_api": ([8001], ["10.0.0.9"]), "router_metrics": ([29000], ["10.0.0.8"]),
                           "frontdoor": ([8000], ["10.0.0.9"]), "frontdoor_metrics": ([3903], ["10.0.0.8"]),
                           "node_exporter": ([9100], ["10.0.0.8"])}
    # Alertmanager on loopback (the default) needs no rule; Prometheus from the monitoring hosts
    assert rules["m1"] == {"prometheus": ([9090], ["10.0.0.8"]), "node_exporter": ([9100], ["10.0.0.8"])}
    assert fw["problems"] == []


@pytest.mark.parametrize(("value", "named"), [
    (5, "host h1, field pd_firewall_host_addresses: 5 is int, expected a list"),
    (["10.0.0.1; drop"], "host h1, field pd_firewall_host_addresses[0]: '10.0.0.1; drop' is not an IP address"),
])
def test_bad_firewall_host_addresses_are_named(value, named):
    peers = {"h1": {"ansible_host": "10.0.0.1", "pd_firewall_host_addresses": value}}
    with pytest.raises(TopologyError) as err:
        cluster_view(_hosts(), [_router()], [], peers)
    assert named in str(err.value)


def test_dns_ansible_host_is_a_firewall_problem_only():
    """A DNS name cannot be matched by nft: the view still composes (firewall off works), pd_firewall refuses."""
    hosts = {"h1": dict(_hosts()["h1"], ansible_host="gpu1.example")}
    fw = cluster_view(hosts, [_router()], [], {"h1": {"ansible_host": "gpu1.example"}})["firewall"]
    assert fw["problems"] == ["host h1, field ansible_host: 'gpu1.example' is not an IP address; the firewall "
                              "matches addresses: set ansible_host to the host's IP, or list its IPs in "
                              "pd_firewall_host_addresses"]
