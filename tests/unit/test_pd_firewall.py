"""pd_firewall: the ruleset is derived from the topology and is valid nftables."""

from __future__ import annotations

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
           "tests/fixtures/playbooks/render_firewall.yml", "-e", f"render_dir={tmp_path}", *extra]
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
        assert expected <= elements(ruleset, "protected_tcp"), host


def test_b300_decode_side_channel_range_covers_every_dp_rank(tmp_path):
    ports = elements(render(tmp_path, "inventory/b300")["b300-03"], "protected_tcp")
    assert {str(p) for p in range(5700, 5708)} <= ports
    assert "5708" not in ports


def test_router_clients_get_their_own_rule(tmp_path):
    rules = render(tmp_path, "inventory/b300", "-e", '{"pd_firewall_router_clients": ["198.51.100.0/24"]}')
    assert "198.51.100.0/24" in elements(rules["b300-03"], "router_clients_v4")
    assert "router_clients_v4" not in rules["b300-01"]


@pytest.mark.skipif(shutil.which("nft") is None and not Path("/usr/sbin/nft").exists(), reason="nft not installed")
@pytest.mark.parametrize("inventory", ["inventory/b300", "inventory/local"])
def test_rulesets_pass_nft_check(tmp_path, inventory):
    for host, ruleset in render(tmp_path, inventory).items():
        path = tmp_path / f"{host}.nft"
        proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{host}: {proc.stderr}\n{ruleset}"
