"""pd_firewall: the ruleset is derived from the topology and is valid nftables (behaviour: test_pd_firewall_netns)."""

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


def render(tmp_path: Path, inventory: str, *extra: str) -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    cmd = [str(ROOT / ".venv/bin/ansible-playbook"), "-i", inventory,
           "tests/fixtures/playbooks/render_firewall.yml", "-e", f"render_dir={tmp_path}",
           "--skip-tags", "frontdoor,known_hosts", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return {p.stem: p.read_text() for p in tmp_path.glob("*.nft")}


def elements(ruleset: str, set_name: str) -> set[str]:
    m = re.search(rf"set {set_name} \{{.*?elements = \{{ ([^}}]*) \}}", ruleset, re.S)
    assert m, f"set {set_name} has no elements"
    return {e.strip() for e in m.group(1).split(",")}


def host_vars(inventory: str, host: str) -> dict:
    path = ROOT / inventory / "host_vars" / f"{host}.yml"
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


@pytest.mark.parametrize("inventory", ["inventory/b300", "inventory/local"])
def test_ports_and_peers_come_from_the_topology(tmp_path, inventory):
    rules = render(tmp_path, inventory)
    hosts = yaml.safe_load((ROOT / inventory / "hosts.yml").read_text())
    addresses = set()

    def walk(node):
        for name, spec in (node.get("hosts") or {}).items():
            if spec and "ansible_host" in spec:
                addresses.add(spec["ansible_host"])
            rules_host = name
            assert rules_host in rules
        for child in (node.get("children") or {}).values():
            walk(child)

    walk(next(iter(hosts.values())))
    for host, ruleset in rules.items():
        assert elements(ruleset, "peers_v4") >= addresses
        expected = set()
        for inst in host_vars(inventory, host).get("pd_instances", []):
            expected.add(str(inst["http_port"]))
            expected.update(str(inst["nixl_side_channel_port"] + r) for r in range(inst["dp_size"]))
            if "dp_rpc_port" in inst:
                expected.add(str(inst["dp_rpc_port"]))
        assert expected <= elements(ruleset, "peer_tcp"), host


def test_b300_decode_side_channel_range_covers_every_dp_rank(tmp_path):
    ports = elements(render(tmp_path, "inventory/b300")["b300-03"], "peer_tcp")
    assert {str(p) for p in range(5700, 5708)} <= ports
    assert "5708" not in ports


def test_router_clients_get_their_own_rule(tmp_path):
    rules = render(tmp_path, "inventory/b300", "-e",
                   '{"pd_firewall_router_clients": ["198.51.100.0/24", "2001:db8:5::/48"]}')
    assert "ip saddr { 198.51.100.0/24 } tcp dport 8000 accept" in rules["b300-03"]
    assert "ip6 saddr { 2001:db8:5::/48 } tcp dport 8000 accept" in rules["b300-03"]
    assert "198.51.100.0/24" not in rules["b300-01"]


def test_input_is_default_deny_with_ssh_and_neighbour_discovery(tmp_path):
    ruleset = render(tmp_path, "inventory/b300")["b300-01"]
    assert "policy drop;" in ruleset
    assert 'counter drop comment "not allowed by pd_firewall (default deny)"' in ruleset
    assert "tcp dport { 22 } accept" in ruleset
    for icmpv6 in ("nd-neighbor-solicit", "nd-neighbor-advert", "nd-router-advert", "packet-too-big"):
        assert icmpv6 in ruleset
    # b300 moves KV over RDMA (UCX_TLS=rc,...): no ephemeral TCP range for peers
    assert "32768-60999" not in elements(ruleset, "peer_tcp")


def test_ssh_sources_restrict_ssh(tmp_path):
    rules = render(tmp_path, "inventory/b300", "-e",
                   '{"pd_firewall_ssh_sources": ["203.0.113.0/24", "2001:db8:9::/48"], "ansible_port": 2222}')
    assert "ip saddr { 203.0.113.0/24 } tcp dport { 2222 } accept" in rules["b300-01"]
    assert "ip6 saddr { 2001:db8:9::/48 } tcp dport { 2222 } accept" in rules["b300-01"]
    assert "tcp dport { 2222 } accept" not in rules["b300-01"].replace("} tcp dport { 2222 } accept", "")


def test_ipv6_addresses_are_peers(tmp_path):
    rules = render(tmp_path, "inventory/b300", "-e", '{"pd_firewall_extra_peers": ["2001:db8::/64", "203.0.113.9"]}')
    assert elements(rules["b300-01"], "peers_v6") == {"2001:db8::/64"}
    assert "203.0.113.9" in elements(rules["b300-01"], "peers_v4")


@pytest.mark.parametrize(("ucx_env", "expected"), [
    ({"UCX_TLS": "tcp,self,sm"}, {"32768-60999"}),
    ({"UCX_TLS": "tcp", "UCX_TCP_PORT_RANGE": "20000-20999"}, {"20000-20999"}),
    ({"UCX_TLS": "^ib"}, {"32768-60999"}),
    ({}, {"32768-60999"}),
    ({"UCX_TLS": "rc,cuda_copy,cuda_ipc,sm,self"}, set()),
    ({"UCX_TLS": "^tcp,ib"}, set()),
])
def test_peer_port_range_follows_ucx_transports(tmp_path, ucx_env, expected):
    ruleset = render(tmp_path, "inventory/b300", "-e", json.dumps({"pd_ucx_env": ucx_env}))["b300-01"]
    assert {e for e in elements(ruleset, "peer_tcp") if "-" in e} == expected


@pytest.mark.parametrize(("extra", "named"), [
    ({"pd_firewall_extra_peers": ["10.0.0.1; drop"]}, "not an IP/CIDR: 10.0.0.1; drop"),
    ({"pd_firewall_ssh_sources": ["bastion.example"]}, "not an IP/CIDR: bastion.example"),
    ({"pd_firewall_peer_port_ranges": ["40000:41000"]}, "pd_firewall_peer_port_ranges: not low-high: 40000:41000"),
    ({"pd_firewall_client_ports": [{"sources": []}]}, "pd_firewall_client_ports entry without port"),
])
def test_bad_addresses_are_named_before_rendering(tmp_path, extra, named):
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    cmd = [str(ROOT / ".venv/bin/ansible-playbook"), "-i", "inventory/b300", "-l", "b300-01",
           "tests/fixtures/playbooks/render_firewall.yml", "-e", f"render_dir={tmp_path}",
           "--skip-tags", "frontdoor,known_hosts", "-e", json.dumps(extra)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert named in proc.stdout, proc.stdout[-3000:]
    assert not list(tmp_path.glob("*.nft"))


@pytest.mark.skipif(shutil.which("nft") is None and not Path("/usr/sbin/nft").exists(), reason="nft not installed")
@pytest.mark.parametrize("inventory", ["inventory/b300", "inventory/local"])
def test_rulesets_pass_nft_check(tmp_path, inventory):
    for host, ruleset in render(tmp_path, inventory).items():
        path = tmp_path / f"{host}.nft"
        proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{host}: {proc.stderr}\n{ruleset}"
