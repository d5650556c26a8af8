"""pd_firewall's rendered b300 rulesets, loaded into a real network namespace, against real TCP connections.

Topology (all namespaces made here, removed in a finalizer): a server namespace holding one host's ruleset,
listening on every port under test (IPv4 and IPv6), linked by one veth pair each to a client namespace that has a
b300 host's address (b300-01 192.0.2.11: prefill only; b300-02 192.0.2.12: prefill and router host; b300-03
192.0.2.13: decode, router and monitoring host) or an outsider's (198.51.100.7). IPv6 addresses are resolved by
neighbour discovery through the firewall (its ICMPv6 rules are exercised too). A connection that is dropped times
out; the listener accepts every port it listens on, so "open" means the firewall let the SYN through.
The load decision (tasks/live.yml: the loaded table's digest against the file's) runs with ansible-playbook inside
a namespace of its own. Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_collections.b300.pd.tests.unit.test_pd_firewall import render

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = {
    "b300-01": {"v4": "192.0.2.11", "v6": "2001:db8::11"},
    "b300-02": {"v4": "192.0.2.12", "v6": "2001:db8::12"},
    "b300-03": {"v4": "192.0.2.13", "v6": "2001:db8::13"},
    "outsider": {"v4": "198.51.100.7", "v6": "2001:db8:1::7"},
}
CONNECT_TIMEOUT_S = 1.5
# b300's ports (inventory/b300): SSH, front door, router API (P/D, colocated), router metrics, mtail, Prometheus,
# node exporter, DCGM exporter, vLLM HTTP (prefill, decode), NIXL side channel (prefill, decode), DP RPC, two
# unlisted ports (one in Linux's ephemeral range).
SSH, FRONTDOOR, ROUTER_API, ROUTER_METRICS, MTAIL = 22, 8000, 8001, 29000, 3903
PROMETHEUS, NODE, DCGM = 9090, 9100, 9400
PREFILL_HTTP, DECODE_HTTP, PREFILL_NIXL, DECODE_NIXL, DP_RPC = 8100, 8200, 5600, 5700, 13345
UNLISTED = (29500, 47000)
PORTS = (SSH, FRONTDOOR, ROUTER_API, ROUTER_METRICS, MTAIL, PROMETHEUS, NODE, DCGM, PREFILL_HTTP, DECODE_HTTP,
         PREFILL_NIXL, DECODE_NIXL, DP_RPC, *UNLISTED)

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


def _run(*cmd, check=True, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, check=check, **kw)


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
    """A server namespace and one client namespace per CLIENTS entry; `matrix()` connects from the clients."""

    def __init__(self, ports):
        tag = f"pdfw{os.getpid()}"
        self.ns = {"server": f"{tag}s", **{c: f"{tag}c{i}" for i, c in enumerate(CLIENTS)}}
        self.server = {c: {"v4": f"198.18.{i}.1", "v6": f"2001:db8:ff{i}::1"} for i, c in enumerate(CLIENTS)}
        self.ports = sorted(set(ports))
        self.listener = None

    def exec(self, ns, *cmd, check=True):
        return _run("ip", "netns", "exec", self.ns[ns], *cmd, check=check)

    def up(self):
        for name in self.ns.values():
            _run("ip", "netns", "add", name)
        for ns in self.ns:
            self.exec(ns, "ip", "link", "set", "lo", "up")
        for i, (client, addrs) in enumerate(CLIENTS.items()):
            srv_if = f"s-{i}"
            _run("ip", "link", "add", srv_if, "netns", self.ns["server"], "type", "veth", "peer", "name", "eth0",
                 "netns", self.ns[client])
            server = self.server[client]
            # point to point: each end's address as a host route to the other (no shared subnet between links)
            for ns, ifname, mine, other in (("server", srv_if, server, addrs), (client, "eth0", addrs, server)):
                self.exec(ns, "ip", "addr", "add", f"{mine['v4']}/32", "dev", ifname)
                # nodad: usable at once, no wait for duplicate address detection
                self.exec(ns, "ip", "-6", "addr", "add", f"{mine['v6']}/128", "dev", ifname, "nodad")
                self.exec(ns, "ip", "link", "set", ifname, "up")
                self.exec(ns, "ip", "route", "add", f"{other['v4']}/32", "dev", ifname)
                self.exec(ns, "ip", "-6", "route", "add", f"{other['v6']}/128", "dev", ifname)
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

    def probe(self, ns, targets, *as_user):
        """{(address, port): "open" | error name} for [[address, port], ...], connected from namespace ns (as_user:
        a command prefix that changes the user; the distribution's python3, which any user can run)."""
        python = "/usr/bin/python3" if as_user else sys.executable
        proc = self.exec(ns, *as_user, python, "-c", PROBE, str(CONNECT_TIMEOUT_S), json.dumps(targets))
        return {(addr, port): result for addr, port, result in json.loads(proc.stdout)}

    def matrix(self, ports, clients=tuple(CLIENTS), families=("v4",)):
        """{(client, family, port): "open" | error name} for every client, family and port."""
        out = {}
        for client in clients:
            targets = [[self.server[client][fam], port] for fam in families for port in ports]
            for (addr, port), result in self.probe(client, targets).items():
                out[(client, "v6" if ":" in addr else "v4", port)] = result
        return out


@pytest.fixture(scope="module")
def lab():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    lab = Lab(PORTS)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="module")
def b300_rulesets(tmp_path_factory):
    """The b300 inventory's rulesets as the role writes them (host -> path)."""
    out = tmp_path_factory.mktemp("b300")
    render(out, "inventory/b300")
    return {p.stem: p for p in out.glob("*.nft")}


def _check(lab, ruleset, expected, families=("v4",)):
    """Loads ruleset, connects from every client to every port; expected: {(client, port): True (open)} for the
    open ones, every other (client, port) must be refused."""
    lab.load(ruleset)
    result = lab.matrix(PORTS, families=families)
    wrong = {}
    for (client, fam, port), got in result.items():
        want_open = expected.get((client, port), False)
        if (got == "open") != want_open:
            wrong[(client, fam, port)] = got
    assert not wrong, f"(client, family, port) -> result where the firewall is wrong: {wrong}"


def _open(clients, ports):
    return {(c, p): True for c in clients for p in ports}


def test_b300_prefill_only_host(lab, b300_rulesets):
    """b300-01 (prefill only): the router hosts reach vLLM HTTP, NIXL only from the decode host, metrics only
    from the monitoring host; the router host b300-02 (a prefill host) is refused NIXL and node exporter."""
    expected = {**_open(CLIENTS, [SSH]),  # SSH sources default to any address
                **_open(["b300-02", "b300-03"], [PREFILL_HTTP]),
                **_open(["b300-03"], [PREFILL_NIXL, NODE, DCGM]),
                **_open(["b300-01", "b300-02", "b300-03"], [DP_RPC])}
    _check(lab, b300_rulesets["b300-01"], expected)


def test_b300_router_monitoring_decode_host(lab, b300_rulesets):
    """b300-03 (decode, router, monitoring): from the prefill-only host the router admin API, node exporter,
    Prometheus, the front door and vLLM HTTP are refused (only the NIXL side channel of the decode instance, and DP
    RPC, are open to it); the other router host reaches the router API, front door and vLLM HTTP, not Prometheus."""
    expected = {**_open(CLIENTS, [SSH]),
                **_open(["b300-01", "b300-02"], [DECODE_NIXL]),
                **_open(["b300-01", "b300-02", "b300-03"], [DP_RPC]),
                **_open(["b300-02", "b300-03"], [ROUTER_API, FRONTDOOR, DECODE_HTTP]),
                **_open(["b300-03"], [ROUTER_METRICS, MTAIL, PROMETHEUS, NODE, DCGM])}
    _check(lab, b300_rulesets["b300-03"], expected)


def test_b300_monitoring_host_reaches_the_metrics_of_a_router_host(lab, b300_rulesets):
    """b300-02 (prefill and router host): the monitoring host scrapes vLLM /metrics, router metrics, mtail, node
    and DCGM exporters; the prefill-only host reaches none of the router's ports."""
    expected = {**_open(CLIENTS, [SSH]),
                **_open(["b300-02", "b300-03"], [PREFILL_HTTP, ROUTER_API, FRONTDOOR]),
                **_open(["b300-03"], [PREFILL_NIXL, ROUTER_METRICS, MTAIL, NODE, DCGM]),
                **_open(["b300-01", "b300-02", "b300-03"], [DP_RPC])}
    _check(lab, b300_rulesets["b300-02"], expected)


def test_b300_vllm_user_reaches_only_vllm_services_on_a_router_host(lab, b300_rulesets):
    """b300-03 runs the decode instance beside routers, Prometheus and the front door: over loopback (and to the
    host's own address) a vLLM process (the rendered rulesets name `nobody` for the vLLM user) is refused every
    service port that is not vLLM's own: the routers' admin API above all; root (nginx, the routers, Prometheus
    are other users) reaches them all."""
    lab.load(b300_rulesets["b300-03"])
    own_address = lab.server["b300-02"]["v4"]
    targets = [["127.0.0.1", p] for p in PORTS] + [["::1", ROUTER_API], [own_address, ROUTER_API]]
    denied = {FRONTDOOR, ROUTER_API, ROUTER_METRICS, MTAIL, PROMETHEUS, NODE, DCGM}
    as_vllm = lab.probe("server", targets, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    wrong = {t: r for t, r in as_vllm.items() if (r == "open") == (t[1] in denied)}
    assert not wrong, f"(address, port) -> result where the vLLM user's egress is wrong: {wrong}"
    # refused at once (a reset), not left to time out
    assert as_vllm[("127.0.0.1", ROUTER_API)] == "ConnectionRefusedError"
    as_root = lab.probe("server", targets)
    assert all(r == "open" for r in as_root.values()), as_root


def test_b300_ipv6_clients_and_extra_peers(lab, tmp_path):
    """IPv6: a front-door client (pd_firewall_router_clients) reaches the front door only; an extra peer
    (pd_firewall_extra_peers, e.g. the control node) every service port; the cluster's IPv4-only hosts nothing."""
    extra = {"pd_firewall_router_clients": [f"{CLIENTS['outsider']['v6']}/128"],
             "pd_firewall_extra_peers": [CLIENTS["b300-01"]["v6"]]}
    render(tmp_path, "inventory/b300", "-e", json.dumps(extra))
    services = [FRONTDOOR, ROUTER_API, ROUTER_METRICS, MTAIL, PROMETHEUS, NODE, DCGM, DECODE_HTTP, DECODE_NIXL,
                DP_RPC]
    expected = {**_open(CLIENTS, [SSH]), **_open(["outsider"], [FRONTDOOR]), **_open(["b300-01"], services)}
    _check(lab, tmp_path / "b300-03.nft", expected, families=("v6",))


def test_local_ucx_tcp_range_is_open_to_vllm_hosts_only(lab, tmp_path):
    """The embedded default moves KV over UCX's TCP transport (ephemeral ports): the vLLM hosts (here an extra
    peer standing in for one) reach them, others not."""
    render(tmp_path, "inventory/local", "-e", json.dumps({"pd_firewall_extra_peers": [CLIENTS["b300-02"]["v4"]]}))
    lab.load(tmp_path / "pd-prefill-0.nft")
    result = lab.matrix([47000, 29500], clients=("b300-02", "outsider"))
    assert result[("b300-02", "v4", 47000)] == "open"  # in 32768-60999
    assert result[("outsider", "v4", 47000)] != "open"
    assert result[("b300-02", "v4", 29500)] != "open"  # below the ephemeral range, not listed


def test_ssh_only_fallback_keeps_ssh_open_and_denies_the_rest(lab, tmp_path):
    """A failed first install is rolled back to the SSH-only default-deny table, never to no table."""
    render(tmp_path, "inventory/b300")
    lab.load(tmp_path / "b300-03.ssh-only")
    _check(lab, tmp_path / "b300-03.ssh-only", _open(CLIENTS, [SSH]))


LIVE_PLAY = """
- name: Run pd_firewall's load decision against this namespace's tables
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Compare the loaded table with the file
      ansible.builtin.include_role:
        name: b300.pd.pd_firewall
        tasks_from: live.yml
    - name: Write the decision
      ansible.builtin.copy:
        content: "{{ {'needs_load': _pd_firewall_needs_load | bool, 'present': _pd_firewall_live_present | bool,
                      'live': _pd_firewall_live_digest} | to_json }}"
        dest: "{{ out }}"
        mode: "0644"
"""


def _digest(path):
    return re.search(r'comment "pd_firewall sha256:([0-9a-f]{64})"', path.read_text()).group(1)


def _old_and_new_rulesets(tmp_path):
    """b300-01's ruleset as rendered, and a changed one (one more extra peer); skips without network namespaces."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    render(tmp_path / "old", "inventory/b300", "-l", "b300-01")
    render(tmp_path / "new", "inventory/b300", "-l", "b300-01",
           "-e", json.dumps({"pd_firewall_extra_peers": ["203.0.113.9"]}))
    return tmp_path / "old" / "b300-01.nft", tmp_path / "new" / "b300-01.nft"


def test_load_is_keyed_on_the_live_table(tmp_path):
    """tasks/live.yml decides from the loaded table, whatever the last run wrote: no table -> load; the file
    loaded -> nothing to do; a new file written but not loaded (a run interrupted between write and load, so the
    next run sees the file unchanged) -> load; a table without a digest (an older role) -> load."""
    old, new = _old_and_new_rulesets(tmp_path)
    play = tmp_path / "live.yml"
    play.write_text(LIVE_PLAY)
    ns = f"pdfw{os.getpid()}live"
    # Facts in memory and this Python for the modules: the clone's fact cache (.cache/facts) would keep whatever
    # interpreter an earlier local play discovered on another PATH (a pyenv shim that cannot run here).
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_CACHE_PLUGIN="memory",
               ANSIBLE_PYTHON_INTERPRETER=sys.executable)

    def decide(digest):
        out = tmp_path / "decision.json"
        proc = _run("ip", "netns", "exec", ns, str(ROOT / ".venv/bin/ansible-playbook"), "-i", "localhost,",
                    str(play), "-e", json.dumps({"_pd_firewall_digest": digest, "out": str(out)}),
                    check=False, cwd=ROOT, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        return json.loads(out.read_text())

    _run("ip", "netns", "add", ns)
    try:
        assert decide(_digest(old)) == {"needs_load": True, "present": False, "live": ""}
        _run("ip", "netns", "exec", ns, "nft", "-f", str(old))
        assert decide(_digest(old)) == {"needs_load": False, "present": True, "live": _digest(old)}
        # the new file is on disk (its write was the change), the load never happened: still loaded next run
        assert decide(_digest(new)) == {"needs_load": True, "present": True, "live": _digest(old)}
        _run("ip", "netns", "exec", ns, "nft", "-f", str(new))
        assert decide(_digest(new))["needs_load"] is False
        # a table from before the digest (or edited by hand): loaded again
        legacy = tmp_path / "legacy.nft"
        legacy.write_text(new.read_text().replace(f' comment "pd_firewall sha256:{_digest(new)}"', ""))
        _run("ip", "netns", "exec", ns, "nft", "-f", str(legacy))
        assert decide(_digest(new)) == {"needs_load": True, "present": True, "live": ""}
    finally:
        _run("ip", "netns", "del", ns, check=False)


def _rollback_script(**variables):
    """The rollback timer's shell script as rules.yml's "Arm the rollback timer" task renders it."""
    tasks = yaml.safe_load((ROOT / "roles/pd_firewall/tasks/rules.yml").read_text())
    block = next(t for t in tasks if t.get("name") == "Load the ruleset with a timed rollback")["block"]
    arm = next(t for t in block if t.get("name") == "Arm the rollback timer")
    restore = Templar(loader=DataLoader(), variables=variables).template(
        trust_as_template(arm["vars"]["_pd_firewall_restore"]))
    return Templar(loader=DataLoader(), variables={**variables, "_pd_firewall_restore": restore}).template(
        trust_as_template(arm["ansible.builtin.command"]["argv"][-1]))


@pytest.mark.parametrize("first_install", [True, False])
def test_rollback_restores_the_loaded_table_or_the_ssh_only_one(tmp_path, first_install):
    """The rollback timer's script, run in a namespace after the new ruleset was loaded: on a first install the
    SSH-only default-deny table is loaded (never no table) and becomes the file, the new one kept as .rejected;
    otherwise the table loaded before (saved from the live table as rules.yml does) comes back, file and table."""
    old, new = _old_and_new_rulesets(tmp_path)
    etc = tmp_path / "etc"
    etc.mkdir()
    rules, previous, fallback = etc / "pd-firewall.nft", etc / "pd-firewall.nft.previous", etc / "ssh-only.nft"
    fallback.write_text((tmp_path / "new" / "b300-01.ssh-only").read_text())
    ns = f"pdfw{os.getpid()}rb"
    _run("ip", "netns", "add", ns)
    try:
        if not first_install:
            _run("ip", "netns", "exec", ns, "nft", "-f", str(old))
            listed = _run("ip", "netns", "exec", ns, "nft", "list", "table", "inet", "pd_firewall").stdout
            previous.write_text(f"table inet pd_firewall {{}}\ndelete table inet pd_firewall\n{listed}\n")
        rules.write_text(new.read_text())
        _run("ip", "netns", "exec", ns, "nft", "-f", str(rules))  # the load the controller never confirmed
        script = _rollback_script(pd_firewall_rules_path=str(rules), _pd_firewall_live_present=not first_install,
                                  _pd_firewall_previous_path=str(previous), _pd_firewall_fallback_path=str(fallback))
        _run("ip", "netns", "exec", ns, "/bin/sh", "-c", script)
        live = _run("ip", "netns", "exec", ns, "nft", "list", "table", "inet", "pd_firewall").stdout
        if first_install:
            assert 'comment "pd_firewall ssh-only fallback"' in live and "policy drop;" in live
            assert "ssh from anywhere (fallback)" in live
            assert rules.read_text() == fallback.read_text()
            assert Path(f"{rules}.rejected").read_text() == new.read_text()
        else:
            assert f"pd_firewall sha256:{_digest(old)}" in live and "203.0.113.9" not in live
            assert rules.read_text() == previous.read_text()
    finally:
        _run("ip", "netns", "del", ns, check=False)
