"""pd_firewall: the ruleset is the cluster view's port matrix (issue 32) and is valid nftables (behaviour:
test_pd_firewall_netns)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# validate.yml refuses an inventory without the workers' key (b300 reads it from vault); the rulesets don't need it.
NO_KEY = ("-e", json.dumps({"vllm_serve_api_key_required": False}))


def render(tmp_path: Path, inventory: str, *extra: str) -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    cmd = [str(ROOT / ".venv/bin/ansible-playbook"), "-i", inventory,
           "tests/fixtures/playbooks/render_firewall.yml", "-e", f"render_dir={tmp_path}",
           "--skip-tags", "frontdoor,known_hosts", *NO_KEY, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return {p.stem: p.read_text() for p in tmp_path.glob("*.nft")}


def elements(ruleset: str, set_name: str) -> set[str]:
    """The elements of a named set (empty when it has none)."""
    m = re.search(rf"set {set_name} \{{(.*?)\n  \}}", ruleset, re.S)
    assert m, f"no set {set_name}"
    body = re.search(r"elements = \{ ([^}]*) \}", m.group(1))
    return {e.strip() for e in body.group(1).split(",")} if body else set()


def rules_of(ruleset: str) -> dict[str, dict[str, set[str]]]:
    """service -> {ports, v4, v6} of every accept rule (SSH from anywhere: v4/v6 = {"any"})."""
    out = {}
    for name, ports in re.findall(r"ip saddr @(\w+)_v4 tcp dport \{ ([^}]*) \} accept", ruleset):
        out[name] = {"ports": set(ports.split(", ")), "v4": elements(ruleset, f"{name}_v4"),
                     "v6": elements(ruleset, f"{name}_v6")}
    for ports, service in re.findall(r"^    tcp dport \{ ([^}]*) \} accept comment \"(\w+) from anywhere\"", ruleset,
                                     re.M):
        out[service] = {"ports": set(ports.split(", ")), "v4": {"any"}, "v6": {"any"}}
    return out


def host_vars(inventory: str, host: str) -> dict:
    path = ROOT / inventory / "host_vars" / f"{host}.yml"
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


B300 = {"b300-01": "192.0.2.11", "b300-02": "192.0.2.12", "b300-03": "192.0.2.13"}


def test_b300_port_matrix(tmp_path):
    """Each service port of each b300 host admits exactly the hosts that need it (issue 32, item 1)."""
    rules = {host: rules_of(r) for host, r in render(tmp_path, "inventory/b300").items()}
    prefill_only, router_prefill, mon_router_decode = B300["b300-01"], B300["b300-02"], B300["b300-03"]
    routers, mon = {router_prefill, mon_router_decode}, {mon_router_decode}
    want = {
        "b300-01": {"vllm_http": ({"8100", "8101"}, routers), "dp_rpc": ({"13345", "13355"}, set(B300.values())),
                    "nixl_side_channel_prefill": ({str(p) for p in [*range(5600, 5604), *range(5610, 5614)]},
                                                  {mon_router_decode}),
                    "node_exporter": ({"9100"}, mon), "dcgm_exporter": ({"9400"}, mon)},
        "b300-03": {"vllm_http": ({"8200"}, routers), "dp_rpc": ({"13345"}, set(B300.values())),
                    "nixl_side_channel_decode": ({str(p) for p in range(5700, 5708)},
                                                 {prefill_only, router_prefill}),
                    "router_api": ({"8001", "8009"}, routers), "frontdoor": ({"8000"}, routers),
                    "router_metrics": ({"29000", "29009"}, mon), "frontdoor_metrics": ({"3903"}, mon),
                    "prometheus": ({"9090"}, mon), "node_exporter": ({"9100"}, mon), "dcgm_exporter": ({"9400"}, mon)},
    }
    for host, services in want.items():
        got = {name: (r["ports"], r["v4"]) for name, r in rules[host].items() if name != "ssh"}
        assert got == services, host
    # b300-02: a prefill host that is also a router host (front door, router units), not the monitoring host
    assert rules["b300-02"]["router_api"]["v4"] == routers
    assert "prometheus" not in rules["b300-02"]
    # the routers' admin API is never open to a vLLM-only host
    for host in ("b300-02", "b300-03"):
        assert prefill_only not in rules[host]["router_api"]["v4"]


def vllm_egress_denied(ruleset: str) -> set[str] | None:
    """The ports the output chain refuses to the vLLM user (None: no output chain)."""
    m = re.search(r'^    meta skuid "[^"]+" tcp dport \{ ([^}]*) \} counter reject', ruleset, re.M)
    return set(m.group(1).split(", ")) if m else None


def test_vllm_user_is_refused_every_service_that_is_not_vllm_s_own(tmp_path):
    """A vLLM process on a router or monitoring host reaches that host's services over loopback, where the input
    rules never look: on every vLLM host the vLLM user is refused every other service port of the cluster (routers
    and their admin API, front door, mtail, Prometheus, Alertmanager on loopback too, exporters), never one of
    vLLM's own; a host without vLLM has no such chain."""
    (tmp_path / "b300").mkdir()
    (tmp_path / "local").mkdir()
    b300 = render(tmp_path / "b300", "inventory/b300")
    want = {"8000", "3903", "8001", "8009", "29000", "29009", "9090", "9093", "9100", "9400"}
    for host, ruleset in b300.items():
        assert vllm_egress_denied(ruleset) == want, host
        assert 'meta skuid "nobody"' in ruleset  # the render's stand-in for the vLLM user
    local = render(tmp_path / "local", "inventory/local")
    assert vllm_egress_denied(local["pd-router-0"]) is None
    denied = vllm_egress_denied(local["pd-prefill-0"])
    own = {p for host in local.values() for name, r in rules_of(host).items()
           if name in ("vllm_http", "nixl_side_channel_prefill", "nixl_side_channel_decode", "dp_rpc", "ucx_tcp")
           for p in r["ports"]}
    assert denied and not denied & own, (denied, own)
    assert vllm_egress_denied(local["pd-decode-0"]) == denied


def test_local_port_matrix_keeps_the_embedded_default_working(tmp_path):
    """inventory/local: the control node (extra peer) reaches every service; the router/monitoring host the
    instances; the vLLM hosts each other's NIXL and UCX TCP ports."""
    rules = {host: rules_of(r) for host, r in render(tmp_path, "inventory/local").items()}
    control = "10.237.0.1/32"
    for host, services in rules.items():
        for name, rule in services.items():
            if name != "ssh":
                assert control in rule["v4"], (host, name)
    assert rules["pd-prefill-0"]["vllm_http"]["v4"] == {"10.237.0.13", control}
    assert rules["pd-prefill-0"]["nixl_side_channel_prefill"]["v4"] == {"10.237.0.12", control}
    assert rules["pd-decode-0"]["ucx_tcp"] == {"ports": {"32768-60999"}, "v4": {"10.237.0.11", "10.237.0.12", control},
                                               "v6": set()}
    assert "ucx_tcp" not in rules["pd-router-0"]


def test_b300_decode_side_channel_range_covers_every_dp_rank(tmp_path):
    ports = rules_of(render(tmp_path, "inventory/b300")["b300-03"])["nixl_side_channel_decode"]["ports"]
    assert {str(p) for p in range(5700, 5708)} == ports


def test_router_clients_reach_the_front_door_only(tmp_path):
    rules = render(tmp_path, "inventory/b300", "-e",
                   '{"pd_firewall_router_clients": ["198.51.100.0/24", "2001:db8:5::/48"]}')
    front = rules_of(rules["b300-03"])["frontdoor"]
    assert "198.51.100.0/24" in front["v4"] and front["v6"] == {"2001:db8:5::/48"}
    assert "198.51.100.0/24" not in rules["b300-01"]
    assert "198.51.100.0/24" not in rules["b300-03"].replace(rules["b300-03"].split("set frontdoor_v4")[1]
                                                             .split("\n  }")[0], "")


def test_operator_sources_reach_prometheus_only(tmp_path):
    rules = rules_of(render(tmp_path, "inventory/b300", "-e",
                            '{"pd_firewall_operator_sources": ["203.0.113.5"]}')["b300-03"])
    assert "203.0.113.5" in rules["prometheus"]["v4"]
    assert [n for n, r in rules.items() if "203.0.113.5" in r["v4"]] == ["prometheus"]


def test_input_is_default_deny_with_ssh_and_neighbour_discovery(tmp_path):
    ruleset = render(tmp_path, "inventory/b300")["b300-01"]
    assert "policy drop;" in ruleset
    assert 'counter drop comment "not allowed by pd_firewall (default deny)"' in ruleset
    assert rules_of(ruleset)["ssh"] == {"ports": {"22"}, "v4": {"any"}, "v6": {"any"}}
    for icmpv6 in ("nd-neighbor-solicit", "nd-neighbor-advert", "nd-router-advert", "packet-too-big"):
        assert icmpv6 in ruleset
    # b300 moves KV over RDMA (UCX_TLS=rc,...): no ephemeral TCP range
    assert "ucx_tcp" not in rules_of(ruleset)


def test_ssh_sources_restrict_ssh(tmp_path):
    rules = render(tmp_path, "inventory/b300", "-e",
                   '{"pd_firewall_ssh_sources": ["203.0.113.0/24", "2001:db8:9::/48"], "ansible_port": 2222}')
    ssh = rules_of(rules["b300-01"])["ssh"]
    assert ssh == {"ports": {"2222"}, "v4": {"203.0.113.0/24"}, "v6": {"2001:db8:9::/48"}}
    assert "from anywhere" not in rules["b300-01"]


def test_extra_peers_reach_every_service(tmp_path):
    rules = rules_of(render(tmp_path, "inventory/b300", "-e",
                            '{"pd_firewall_extra_peers": ["2001:db8::/64", "203.0.113.9"]}')["b300-01"])
    for name, rule in rules.items():
        if name != "ssh":
            assert rule["v6"] == {"2001:db8::/64"} and "203.0.113.9" in rule["v4"], name


@pytest.mark.parametrize(("ucx_env", "expected"), [
    ({"UCX_TLS": "tcp,self,sm"}, {"32768-60999"}),
    ({"UCX_TLS": "tcp", "UCX_TCP_PORT_RANGE": "20000-20999"}, {"20000-20999"}),
    ({"UCX_TLS": "^ib"}, {"32768-60999"}),
    ({}, {"32768-60999"}),
    ({"UCX_TLS": "rc,cuda_copy,cuda_ipc,sm,self"}, set()),
    ({"UCX_TLS": "^tcp,ib"}, set()),
])
def test_peer_port_range_follows_ucx_transports(tmp_path, ucx_env, expected):
    rules = rules_of(render(tmp_path, "inventory/b300", "-e", json.dumps({"pd_ucx_env": ucx_env}))["b300-01"])
    assert rules.get("ucx_tcp", {}).get("ports", set()) == expected
    if expected:
        assert rules["ucx_tcp"]["v4"] == set(B300.values())  # the vLLM hosts only


def test_ruleset_carries_its_digest(tmp_path):
    """The first rule's comment is the sha256 of the file with the digest left out (what live.yml compares)."""
    import hashlib

    ruleset = render(tmp_path, "inventory/b300")["b300-01"]
    digest = re.search(r'comment "pd_firewall sha256:([0-9a-f]{64})"', ruleset).group(1)
    assert hashlib.sha256(ruleset.replace(digest, "@PD_FIREWALL_DIGEST@").encode()).hexdigest() == digest
    (tmp_path / "x").mkdir()
    other = render(tmp_path / "x", "inventory/b300", "-e", '{"pd_firewall_extra_peers": ["203.0.113.9"]}')["b300-01"]
    assert digest not in other


def test_load_is_keyed_on_the_live_table_not_on_a_change():
    """rules.yml loads when live.yml finds the loaded table differs from the file, never on `is changed` (an
    interrupted run's file would never be loaded); test_pd_firewall_netns runs live.yml against real tables."""
    tasks = yaml.safe_load((ROOT / "roles/pd_firewall/tasks/rules.yml").read_text())
    load = next(t for t in tasks if t.get("name") == "Load the ruleset with a timed rollback")
    assert load["when"] == ["_pd_firewall_needs_load | bool", "not ansible_check_mode"]
    assert "is changed" not in json.dumps(tasks)
    rollback = next(t for t in load["block"] if t.get("name") == "Arm the rollback timer")
    script = rollback["ansible.builtin.command"]["argv"][-1]
    assert "delete table" not in script  # a failed first install loads the SSH-only table, never none
    assert "_pd_firewall_fallback_path" in rollback["vars"]["_pd_firewall_restore"]


@pytest.mark.parametrize(("extra", "named"), [
    ({"pd_firewall_extra_peers": ["10.0.0.1; drop"]}, "pd_firewall_extra_peers[0]: '10.0.0.1; drop' is not an IP"),
    ({"pd_firewall_ssh_sources": ["bastion.example"]}, "pd_firewall_ssh_sources[0]: 'bastion.example' is not an IP"),
    ({"pd_firewall_peer_port_ranges": ["40000:41000"]},
     "pd_firewall_peer_port_ranges[0]: '40000:41000' is not a TCP port or range"),
    ({"pd_firewall_client_ports": [{"sources": []}]}, "pd_firewall_client_ports[0]: {'sources': []} is not a {port"),
    ({"pd_firewall_router_clients": "10.0.0.0/8"}, "pd_firewall_router_clients: '10.0.0.0/8' is str, expected a list"),
    ({"pd_firewall_operator_sources": [5]}, "pd_firewall_operator_sources[0]: 5 is "),
    ({"pd_firewall_host_addresses": 5}, "field pd_firewall_host_addresses: 5 is int, expected a list"),
])
def test_bad_addresses_are_named_before_rendering(tmp_path, extra, named):
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    cmd = [str(ROOT / ".venv/bin/ansible-playbook"), "-i", "inventory/b300", "-l", "b300-01",
           "tests/fixtures/playbooks/render_firewall.yml", "-e", f"render_dir={tmp_path}",
           "--skip-tags", "frontdoor,known_hosts", *NO_KEY, "-e", json.dumps(extra)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert named in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("*.nft"))


@pytest.mark.skipif(shutil.which("nft") is None and not Path("/usr/sbin/nft").exists(), reason="nft not installed")
@pytest.mark.parametrize(("inventory", "extra"), [
    ("inventory/b300", {}), ("inventory/local", {}),
    # a network holding the hosts' own addresses, and one of them again: overlapping elements of one set
    ("inventory/b300", {"pd_firewall_extra_peers": ["192.0.2.0/24", "192.0.2.13/32"],
                        "pd_firewall_router_clients": ["192.0.2.12"]}),
])
def test_rulesets_pass_nft_check(tmp_path, inventory, extra):
    for host, ruleset in render(tmp_path, inventory, "-e", json.dumps(extra)).items():
        for path in (tmp_path / f"{host}.nft", tmp_path / f"{host}.ssh-only"):
            proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True, check=False)
            assert proc.returncode == 0, f"{host}: {proc.stderr}\n{ruleset}"


ORDER_PLAY = """
- name: Render the firewall unit and the serving units' drop-ins
  hosts: pd-router-0
  connection: local
  gather_facts: false
  vars_files:
    - {root}/roles/pd_firewall/defaults/main.yml
    - {root}/roles/node_exporter/defaults/main.yml
    - {root}/roles/observability/defaults/main.yml
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{root}/roles/{{{{ item.0 }}}}/templates/{{{{ item.1 }}}}"
        dest: "{out}/{{{{ item.1 }}}}"
        mode: "0644"
      loop:
        - [pd_firewall, pd-firewall.service.j2]
        - [node_exporter, node-exporter-sandbox.conf.j2]
        - [observability, prometheus-sandbox.conf.j2]
        - [observability, alertmanager-sandbox.conf.j2]
      delegate_to: localhost
"""


def _unit_section(text: str, section: str) -> list[str]:
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip()
        elif current == f"[{section}]" and line.strip() and not line.startswith("#"):
            out.append(line.strip())
    return out


@pytest.mark.parametrize("enabled", [True, False])
def test_firewall_loads_before_the_network_and_serving_units_require_it(tmp_path, enabled):
    """pd-firewall.service: no default dependencies, before network-pre.target; node exporter, Prometheus and
    Alertmanager (drop-ins) and the router units Require= and order After= it where the firewall is enabled."""
    play = tmp_path / "order.yml"
    play.write_text(ORDER_PLAY.format(root=ROOT, out=tmp_path))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    proc = subprocess.run([str(ROOT / ".venv/bin/ansible-playbook"), "-i", "inventory/local", str(play),
                           "-e", json.dumps({"pd_firewall_enabled": enabled})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    unit = _unit_section((tmp_path / "pd-firewall.service.j2").read_text(), "Unit")
    assert "DefaultDependencies=no" in unit
    assert "Before=network-pre.target shutdown.target" in unit
    assert any(line.startswith("Wants=network-pre.target") for line in unit)
    assert not any(line.startswith("After=") and "network-pre" in line for line in unit)
    needs = ["Requires=pd-firewall.service", "After=pd-firewall.service"]
    for dropin in ("node-exporter-sandbox.conf.j2", "prometheus-sandbox.conf.j2", "alertmanager-sandbox.conf.j2"):
        assert _unit_section((tmp_path / dropin).read_text(), "Unit") == (needs if enabled else []), dropin
    router = (ROOT / "roles/pd_router/templates/vllm-router.service.j2").read_text()
    unit_part = router.split("[Unit]", 1)[1].split("[Service]", 1)[0]
    assert "Requires={{ pd_firewall_service_name | default('pd-firewall') }}.service" in unit_part
    assert "After={{ pd_firewall_service_name | default('pd-firewall') }}.service" in unit_part


def test_inventories_enable_the_firewall_for_the_other_roles():
    """The serving units' templates read pd_firewall_enabled from the inventory (the role's default is not visible
    in the other plays): both shipped inventories set it."""
    for inventory in ("inventory/local", "inventory/b300"):
        data = yaml.safe_load((ROOT / inventory / "group_vars/all/firewall.yml").read_text())
        assert data["pd_firewall_enabled"] is True, inventory
