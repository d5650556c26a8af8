"""Unit tests of scripts/testhosts' pure parts: names, host specs, inventory parsing, the nftables ruleset."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.scripts.testhosts_lib import config as th
from ansible_collections.b300.pd.scripts.testhosts_lib import system

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("env", ["local", "mol-testhosts_smoke", "mol-vllm_serve", "a" * 40])
def test_link_names_fit_the_kernel_limit(env):
    assert len(th.bridge_name(env)) <= 15
    for host in ("pd-prefill-0", "x" * 63):
        vh, vp = th.veth_names(env, host)
        assert len(vh) <= 15 and len(vp) <= 15
        assert vh != vp


def test_bridge_name_readable_when_it_fits_and_distinct_when_hashed():
    assert th.bridge_name("local") == "pdbr-local"
    assert th.bridge_name("mol-a_b") == "pdbr-mol-a_b"
    long_names = [f"mol-scenario-{i}" for i in range(50)]
    assert len({th.bridge_name(e) for e in long_names}) == 50
    assert th.bridge_name(long_names[0]) == th.bridge_name(long_names[0])  # deterministic: down finds it


def test_veth_names_distinct_across_envs_and_hosts():
    names = {th.veth_names(e, h)[0] for e in ("local", "mol-x") for h in ("a", "b", "c")}
    assert len(names) == 6


def test_parse_hosts():
    assert th.parse_hosts("a=10.238.1.11, b=10.238.1.12") == {"a": "10.238.1.11", "b": "10.238.1.12"}
    for bad in ("a", "a=", "=10.0.0.2", "a=10.0.0.2,a=10.0.0.3", ""):
        with pytest.raises(th.TesthostsError):
            th.parse_hosts(bad)


def test_check_hosts_accepts_one_private_24():
    assert str(th.check_hosts({"a": "10.238.1.11", "b": "10.238.1.254"})) == "10.238.1.0/24"


@pytest.mark.parametrize(
    ("hosts", "fragment"),
    [
        ({"a": "10.238.1.11", "b": "10.238.2.11"}, "share one /24"),
        ({"a": "10.238.1.1"}, "gateway"),
        ({"a": "10.238.1.0"}, "network"),
        ({"a": "10.238.1.255"}, "broadcast"),
        ({"a": "10.238.1.11", "b": "10.238.1.11"}, "both have address"),
        ({"a": "8.8.8.8"}, "not private"),
        ({"a": "10.238.1.300"}, "not an IPv4"),
        ({"Bad_Name": "10.238.1.11"}, "not a valid hostname"),
    ],
)
def test_check_hosts_rejects(hosts, fragment):
    with pytest.raises(th.TesthostsError, match=fragment):
        th.check_hosts(hosts)


def test_inventory_hosts_of_the_local_inventory():
    data = yaml.safe_load((ROOT / "inventory/local/hosts.yml").read_text())
    hosts = th.inventory_hosts(data)
    assert hosts == {"pd-prefill-0": "10.237.0.11", "pd-decode-0": "10.237.0.12", "pd-router-0": "10.237.0.13"}
    th.check_hosts(hosts)  # the local inventory is a valid env


def test_inventory_hosts_walks_children_and_keeps_first_address():
    child = {"hosts": {"a": {"ansible_host": "10.9.9.9"}, "c": {"ansible_host": "10.1.1.3"}}}
    data = {"top": {"hosts": {"a": {"ansible_host": "10.1.1.2"}, "b": None}, "children": {"g": child}}}
    assert th.inventory_hosts(data) == {"a": "10.1.1.2", "c": "10.1.1.3"}


def test_local_bind_mounts_from_inventory():
    hosts, binds, volumes = th.env_config_local()
    assert set(hosts) == {"pd-prefill-0", "pd-decode-0", "pd-router-0"}
    # The model path is its own small filesystem, so the disk-full fault (bench/pd_faults.py) fills only it.
    assert volumes == [("/srv/models", "256M")]
    assert (".cache/wheelhouse", "/srv/wheelhouse") in binds
    assert (".cache/model-src", "/srv/model-src") in binds
    assert (".cache/router-wheelhouse", "/srv/router-wheelhouse") in binds


def test_parse_bind():
    assert th.parse_bind(".cache/x:/srv/x") == (".cache/x", "/srv/x")
    for bad in (".cache/x", ".cache/x:srv/x", ":/srv/x"):
        with pytest.raises(th.TesthostsError):
            th.parse_bind(bad)


def test_nft_ruleset_drops_routed_traffic_per_bridge():
    rs = system.nft_ruleset(["pdbr-local", "pdbr-0123456789"])
    for br in ("pdbr-local", "pdbr-0123456789"):
        assert f'iifname "{br}" oifname != "{br}" counter drop' in rs
        assert f'oifname "{br}" iifname != "{br}" counter drop' in rs
        assert f'iifname "{br}" tcp dport 3142 accept' in rs
        # the proxy accept comes before the catch-all drop of the input chain
        assert rs.index(f'iifname "{br}" tcp dport 3142 accept') < rs.index(f'iifname "{br}" counter drop')
    assert "hook forward" in rs and "hook input" in rs


def test_nft_ruleset_without_bridges_only_deletes_the_table():
    rs = system.nft_ruleset([])
    assert "delete table inet pd_testhosts" in rs
    assert "chain" not in rs


@pytest.mark.skipif(not shutil.which("nft"), reason="nft not installed")
def test_nft_ruleset_is_valid_nft_syntax():
    p = subprocess.run(["nft", "-c", "-f", "-"], input=system.nft_ruleset(["pdbr-local"]), capture_output=True,
                       text=True, check=False)
    if p.returncode != 0 and "Operation not permitted" in p.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN")
    assert p.returncode == 0, p.stderr


def test_local_volume_needs_absolute_dest_and_size(tmp_path, monkeypatch):
    inv = tmp_path / "inventory" / "local"
    inv.mkdir(parents=True)
    (inv / "hosts.yml").write_text("all:\n  hosts:\n    h1:\n      ansible_host: 10.238.9.11\n")
    monkeypatch.setattr(th, "ROOT", tmp_path)
    for bad in ("{dest: srv/models, size: 1G}", "{dest: /srv/models, size: 1T}", "{dest: /srv/models}"):
        (inv / "testhosts.yml").write_text(f"local:\n  vars:\n    pd_testhosts_volumes: [{bad}]\n")
        with pytest.raises(th.TesthostsError, match=r"pd_testhosts_volumes\[0\]"):
            th.env_config_local()
    (inv / "testhosts.yml").write_text("local:\n  vars:\n    pd_testhosts_volumes: [{dest: /srv/m, size: 64M}]\n")
    assert th.env_config_local() == ({"h1": "10.238.9.11"}, [], [("/srv/m", "64M")])
