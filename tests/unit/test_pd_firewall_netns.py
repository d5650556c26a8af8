"""pd_firewall's rendered ruleset, loaded into a real network namespace, against real TCP connections.

Topology (all namespaces made here, removed in a finalizer): a server namespace holding the ruleset, listening on
the ports under test (IPv4 and IPv6), linked by two veth pairs to
  - a peer:     192.0.2.12 (b300-02's ansible_host) and 2001:db8::12 (declared in pd_firewall_host_addresses),
  - a non-peer: 198.51.100.7 and 2001:db8:1::7.
IPv6 addresses are resolved by neighbour discovery through the firewall (its ICMPv6 rules are exercised too).
A connection that is dropped times out; the listener accepts every port it listens on, so "open" means the
firewall let the SYN through. Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.tests.unit.test_pd_firewall import render

ROOT = Path(__file__).resolve().parents[2]
PEER = {"v4": "192.0.2.12", "v6": "2001:db8::12"}
NON_PEER = {"v4": "198.51.100.7", "v6": "2001:db8:1::7"}
SERVER = {"peer": {"v4": "192.0.2.11", "v6": "2001:db8::11"}, "non_peer": {"v4": "198.51.100.1", "v6": "2001:db8:1::1"}}
UNLISTED = (29500, 47000)
SSH = 22
CONNECT_TIMEOUT_S = 1.5

LISTENER = textwrap.dedent("""
    import selectors, socket, sys
    sel = selectors.DefaultSelector()
    for port in map(int, sys.argv[1:]):
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::", port))
        s.listen(128)
        sel.register(s, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            conn, _ = key.fileobj.accept()
            conn.close()
""")

PROBE = textwrap.dedent("""
    import json, socket, sys
    from concurrent.futures import ThreadPoolExecutor
    timeout = float(sys.argv[1])
    targets = json.loads(sys.argv[2])
    def attempt(t):
        try:
            socket.create_connection((t[0], t[1]), timeout=timeout).close()
            return "open"
        except OSError as e:
            return type(e).__name__
    with ThreadPoolExecutor(len(targets)) as pool:
        print(json.dumps([[t[0], t[1], r] for t, r in zip(targets, pool.map(attempt, targets))]))
""")


def _run(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _netns_unavailable():
    if os.geteuid() != 0:
        return "needs root (network namespaces, nft)"
    for tool in ("ip", "nft"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} not installed"
    probe = f"pdfw{os.getpid()}probe"
    if _run("ip", "netns", "add", probe, check=False).returncode != 0:
        return "cannot create network namespaces here"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Lab:
    """Server, peer and non-peer namespaces; `matrix()` connects from the clients to the server's ports."""

    def __init__(self, ports):
        tag = f"pdfw{os.getpid()}"
        self.ns = {"server": f"{tag}s", "peer": f"{tag}p", "non_peer": f"{tag}n"}
        self.ports = sorted(set(ports))
        self.listener = None

    def exec(self, ns, *cmd, check=True):
        return _run("ip", "netns", "exec", self.ns[ns], *cmd, check=check)

    def up(self):
        for name in self.ns.values():
            _run("ip", "netns", "add", name)
        for ns in self.ns:
            self.exec(ns, "ip", "link", "set", "lo", "up")
        for client, addrs in (("peer", PEER), ("non_peer", NON_PEER)):
            srv_if, cli_if = f"s-{client[:4]}", "eth0"
            _run("ip", "link", "add", srv_if, "netns", self.ns["server"], "type", "veth", "peer", "name", cli_if,
                 "netns", self.ns[client])
            server = SERVER[client]
            for ns, ifname, mine in (("server", srv_if, server), (client, cli_if, addrs)):
                self.exec(ns, "ip", "addr", "add", f"{mine['v4']}/24", "dev", ifname)
                # nodad: usable at once, no wait for duplicate address detection
                self.exec(ns, "ip", "-6", "addr", "add", f"{mine['v6']}/64", "dev", ifname, "nodad")
                self.exec(ns, "ip", "link", "set", ifname, "up")
        self.listener = subprocess.Popen(
            ["ip", "netns", "exec", self.ns["server"], sys.executable, "-c", LISTENER, *map(str, self.ports)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.listener.stdout.readline().strip()
        assert line == "ready", f"listener did not start: {line!r} {self.listener.stderr.read()[-2000:]}"

    def down(self):
        if self.listener:
            self.listener.kill()
            self.listener.wait()
        for name in self.ns.values():
            _run("ip", "netns", "del", name, check=False)

    def load(self, ruleset_path):
        proc = self.exec("server", "nft", "-f", str(ruleset_path), check=False)
        assert proc.returncode == 0, proc.stderr

    def matrix(self, ports):
        """{(client, family, port): "open" | error name} for every client, family and port."""
        out = {}
        for client in ("peer", "non_peer"):
            targets = [[SERVER[client][fam], port] for fam in ("v4", "v6") for port in ports]
            proc = self.exec(client, sys.executable, "-c", PROBE, str(CONNECT_TIMEOUT_S), json.dumps(targets))
            for addr, port, result in json.loads(proc.stdout):
                out[(client, "v6" if ":" in addr else "v4", port)] = result
        return out


B300_01 = yaml.safe_load((ROOT / "inventory/b300/host_vars/b300-01.yml").read_text())["pd_instances"]
LISTED = sorted({B300_01[0]["http_port"], B300_01[0]["nixl_side_channel_port"], B300_01[0]["dp_rpc_port"]})
ROUTER_PORT = 8000
B300_03_SIDE_CHANNEL = 5700


@pytest.fixture(scope="module")
def lab():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    lab = Lab([*LISTED, *UNLISTED, SSH, ROUTER_PORT, B300_03_SIDE_CHANNEL])
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


def _ruleset(tmp_path, inventory, host, *extra):
    render(tmp_path, inventory, *extra)
    return tmp_path / f"{host}.nft"


def test_b300_matrix_peer_non_peer_ipv6(lab, tmp_path):
    lab.load(_ruleset(tmp_path, "inventory/b300", "b300-01",
                      "-e", json.dumps({"pd_firewall_host_addresses": [PEER["v6"]]})))
    result = lab.matrix([*LISTED, *UNLISTED, SSH])
    wrong = {}
    for fam in ("v4", "v6"):
        for port in LISTED:
            if result[("peer", fam, port)] != "open":
                wrong[("peer", fam, port)] = result[("peer", fam, port)]
            if result[("non_peer", fam, port)] == "open":
                wrong[("non_peer", fam, port)] = "open"
        for port in UNLISTED:  # default deny: unlisted ports are closed to everyone on b300 (UCX over RDMA)
            for client in ("peer", "non_peer"):
                if result[(client, fam, port)] == "open":
                    wrong[(client, fam, port)] = "open"
        for client in ("peer", "non_peer"):  # SSH sources default to any address
            if result[(client, fam, SSH)] != "open":
                wrong[(client, fam, SSH)] = result[(client, fam, SSH)]
    assert not wrong, f"(client, family, port) -> result where the firewall is wrong: {wrong}"


def test_b300_client_port_open_to_its_clients_only(lab, tmp_path):
    clients = {"pd_firewall_router_clients": [f"{NON_PEER['v4']}/32", f"{NON_PEER['v6']}/128"],
               "pd_firewall_host_addresses": [PEER["v6"]]}
    lab.load(_ruleset(tmp_path, "inventory/b300", "b300-03", "-e", json.dumps(clients)))
    result = lab.matrix([ROUTER_PORT, B300_03_SIDE_CHANNEL])
    for fam in ("v4", "v6"):
        assert result[("non_peer", fam, ROUTER_PORT)] == "open", fam  # a configured client
        assert result[("peer", fam, ROUTER_PORT)] == "open", fam
        assert result[("non_peer", fam, B300_03_SIDE_CHANNEL)] != "open", fam  # still peer-only
        assert result[("peer", fam, B300_03_SIDE_CHANNEL)] == "open", fam


def test_b300_router_port_without_clients_is_peer_only(lab, tmp_path):
    lab.load(_ruleset(tmp_path, "inventory/b300", "b300-03",
                      "-e", json.dumps({"pd_firewall_host_addresses": [PEER["v6"]]})))
    result = lab.matrix([ROUTER_PORT])
    for fam in ("v4", "v6"):
        assert result[("peer", fam, ROUTER_PORT)] == "open", fam
        assert result[("non_peer", fam, ROUTER_PORT)] != "open", fam


def test_local_ucx_tcp_range_is_open_to_peers_only(lab, tmp_path):
    """The embedded default moves KV over UCX's TCP transport (ephemeral ports): peers reach them, others not."""
    peers = {"pd_firewall_extra_peers": [PEER["v4"], PEER["v6"]]}
    lab.load(_ruleset(tmp_path, "inventory/local", "pd-prefill-0", "-e", json.dumps(peers)))
    result = lab.matrix([47000, 29500])
    for fam in ("v4", "v6"):
        assert result[("peer", fam, 47000)] == "open", fam  # in 32768-60999
        assert result[("non_peer", fam, 47000)] != "open", fam
        assert result[("peer", fam, 29500)] != "open", fam  # below the ephemeral range, not listed
