# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The port matrix of each host: every port a vLLM instance (HTTP, NIXL side-channel range, DP RPC) or one of the
bundle's other listeners (router API and metrics, Prometheus, node exporter: `services`) claims, and the clashes."""

from __future__ import annotations

import json

from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import (
    InputError,
    check_address,
    check_list,
    check_type,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_values import as_port, is_int, short


def instance_port_claims(inst):
    """[(port, what)] of one validated instance: its HTTP port, one side-channel port per DP rank, its DP RPC port."""
    name = inst["name"]
    claims = [(inst["http_port"], f"http_port of {name}")]
    dp = inst["dp_size"]
    base = inst["nixl_side_channel_port"]
    for r in range(dp):
        claims.append((base + r, f"NIXL side-channel port of {name} (nixl_side_channel_port {base}, DP rank {r})"))
    if dp > 1 and is_int(inst.get("dp_rpc_port")):
        claims.append((inst["dp_rpc_port"], f"dp_rpc_port of {name}"))
    return claims


def service_claims(problems, services):
    """host -> [(port, what, field)] of the bundle's other listeners (router, Prometheus, ...); bad entries reported."""
    claims = {}
    if services is None:
        return claims
    if not isinstance(services, list):
        problems.append(
            f"services: {short(services)} is not a list of {{host, port, field, service}} "
            "(the pd_topology action plugin builds it from the router / monitoring vars)"
        )
        return claims
    for svc in services:
        if not isinstance(svc, dict) or not isinstance(svc.get("host"), str):
            problems.append(f"services: {short(svc)} is not a {{host, port, field, service}} mapping with a host name")
            continue
        host, field, what = svc["host"], str(svc.get("field") or "port"), str(svc.get("service") or "service")
        port = as_port(svc.get("port"))  # the roles read these ports with | int
        if not is_int(port) or not 1 <= port <= 65535:
            problems.append(
                f"host {host}, field {field}: {short(port)} is not a TCP port ({what}); use an integer in 1024..65535"
            )
            continue
        claims.setdefault(host, []).append((port, f"{field} ({what})", field))
    return claims


def _claim_port(problems, claimed, port, what, *, where, field):
    """Record one listener of a host in claimed (port -> what); a port claimed twice is a problem."""
    if port in claimed:
        problems.append(
            f"{where}, field {field}: port {port} ({what}) is already the {claimed[port]}; pick a free port"
        )
    else:
        claimed[port] = what


def check_host_ports(problems, host, services, instances=()):
    """Port clashes on one host: its services ([(port, what, field)] from service_claims) first, then each
    validated instance's HTTP, NIXL side-channel range and DP RPC ports."""
    claimed = {}
    for port, what, field in services:
        _claim_port(problems, claimed, port, what, where=f"host {host}", field=field)
    for inst in instances:
        for port, what in instance_port_claims(inst):
            field = what.split(" of ", maxsplit=1)[0].replace("NIXL side-channel port", "nixl_side_channel_port")
            _claim_port(problems, claimed, port, what, where=f"host {host}, instance {inst['name']}", field=field)


# ---------------------------------------------------------------------------------------------------------------
# The firewall's port matrix (issue 32): per host, which service ports are reachable from which hosts. The cluster
# view composes it once (firewall_matrix); the pd_firewall role turns one host's rules into its nft ruleset
# (host_ruleset), adding the operator's sources (SSH, clients, the control node).

# Which hosts reach each service: a group of the matrix (vllm: every vLLM host; prefill / decode: the hosts with an
# instance of that pool; routers: the router hosts, where the front doors run; monitoring: the monitoring hosts,
# where Prometheus runs).
FIREWALL_SERVICES = {
    "vllm_http": ("routers", "monitoring"),   # the routers' workers; Prometheus scrapes /metrics on the same port
    # KV moves between the pools: a decode instance pulls from a prefill instance's side channel (and, for any NIXL
    # version that connects the other way, a prefill host reaches a decode host's); never within one pool.
    "nixl_side_channel_prefill": ("decode",),
    "nixl_side_channel_decode": ("prefill",),
    "dp_rpc": ("vllm",),                      # data-parallel ranks of one instance
    "dcgm_exporter": ("monitoring",),
    "node_exporter": ("monitoring",),
    "router_api": ("routers",),               # router units' HTTP port, also their admin API (/workers): front doors
    "router_metrics": ("monitoring",),
    "frontdoor": ("routers",),                # the client port; clients come from pd_firewall_router_clients
    "frontdoor_metrics": ("monitoring",),     # mtail
    "prometheus": ("monitoring",),            # UI/API; operators from pd_firewall_operator_sources
    "alertmanager": ("monitoring",),          # only where it listens beyond loopback
}
_LOOPBACK = ("127.", "::1", "localhost")
# vLLM's own services: what one vLLM process may connect to. Every other port of the matrix is denied to the vLLM
# user on every vLLM host (vllm_egress): the input rules keep other hosts out, but a vLLM process on a host that also
# runs routers or monitoring reaches them over loopback (the routers' admin API /workers has no credential in
# vllm-router 0.1.17), and one on a router host reaches the other router hosts' routers as a router host.
VLLM_OWN_SERVICES = ("vllm_http", "nixl_side_channel_prefill", "nixl_side_channel_decode", "dp_rpc")
# The comment of the ruleset's first rule: the digest of the file, read back from the live table (firewall_digest).
DIGEST_PREFIX = "pd_firewall sha256:"


def _valid_address(value):
    try:
        return check_address("address", value)
    except InputError:
        return None


def firewall_addresses(problems, host, ansible_host, host_addresses):
    """The addresses host's peers connect from: its ansible_host (when an IP) and pd_firewall_host_addresses.
    A host_addresses value that is not a list of IPs/CIDRs is a problem naming the field; an ansible_host that is a
    DNS name is returned in the second list (the firewall cannot match it; pd_firewall refuses it when enabled)."""
    out, unmatched = [], []
    if ansible_host is not None:
        addr = _valid_address(ansible_host)
        if addr is None:
            unmatched.append(f"host {host}, field ansible_host: {short(ansible_host)} is not an IP address; the "
                             "firewall matches addresses: set ansible_host to the host's IP, or list its IPs in "
                             "pd_firewall_host_addresses")
        else:
            out.append(addr)
    if host_addresses is not None:
        try:
            out += check_list(f"host {host}, field pd_firewall_host_addresses", host_addresses, check_address)
        except InputError as err:
            problems.append(str(err))
    return out, unmatched


def firewall_matrix(addresses, vllm, routers, monitoring, *, exporters, dcgm_port=None):
    """{groups, rules, problems}: the port matrix of the cluster view.

    addresses: host -> [IPs/CIDRs it connects from]; vllm: host -> [view instances] (vLLM hosts); routers: the view's
    routers (host, client_port, frontdoor_metrics_port, units); monitoring: [{host, prometheus_port,
    alertmanager_port (None: not deployed), alertmanager_listen_address}]; exporters: host -> node exporter port
    (the hosts Prometheus scrapes); dcgm_port: the DCGM exporter port Prometheus scrapes on the vLLM hosts.
    rules: host -> [{service, ports, from, sources}], sources the addresses of the `from` groups (FIREWALL_SERVICES).
    """
    def group_addresses(hosts):
        return sorted({a for h in hosts for a in addresses.get(h, [])})

    groups = {"vllm": group_addresses(vllm),
              "prefill": group_addresses(h for h, insts in vllm.items() if any(i["pool"] == "prefill" for i in insts)),
              "decode": group_addresses(h for h, insts in vllm.items() if any(i["pool"] == "decode" for i in insts)),
              "routers": group_addresses(r["host"] for r in routers),
              "monitoring": group_addresses(m["host"] for m in monitoring)}
    rules = {}

    def add(host, service, ports):
        ports = sorted({as_port(p) for p in ports if p is not None})
        if not ports:
            return
        sources = sorted({a for g in FIREWALL_SERVICES[service] for a in groups[g]})
        rules.setdefault(host, []).append({"service": service, "ports": ports, "from": list(FIREWALL_SERVICES[service]),
                                           "sources": sources})

    for host, instances in vllm.items():
        rules.setdefault(host, [])
        add(host, "vllm_http", [i["http_port"] for i in instances])
        for pool in ("prefill", "decode"):
            add(host, f"nixl_side_channel_{pool}",
                [p for i in instances if i["pool"] == pool for p in i["nixl_side_channel_ports"]])
        add(host, "dp_rpc", [i.get("dp_rpc_port") for i in instances])
        if instances and monitoring:
            add(host, "dcgm_exporter", [dcgm_port])
    for r in routers:
        rules.setdefault(r["host"], [])
        add(r["host"], "router_api", [u["port"] for u in r["units"]])
        add(r["host"], "router_metrics", [u["metrics_port"] for u in r["units"]])
        add(r["host"], "frontdoor", [r["client_port"]])
        add(r["host"], "frontdoor_metrics", [r["frontdoor_metrics_port"]])
    for m in monitoring:
        rules.setdefault(m["host"], [])
        add(m["host"], "prometheus", [m.get("prometheus_port")])
        listen = str(m.get("alertmanager_listen_address") or "")
        if m.get("alertmanager_port") is not None and listen and not listen.startswith(_LOOPBACK):
            add(m["host"], "alertmanager", [m["alertmanager_port"]])
    if monitoring:
        for host, port in exporters.items():
            add(host, "node_exporter", [port])
    own, denied = set(), set()
    for r in (r for host_rules in rules.values() for r in host_rules):
        (own if r["service"] in VLLM_OWN_SERVICES else denied).update(r["ports"])
    # Alertmanager on loopback has no input rule, and its API (silences) is what a vLLM process beside it must not use.
    denied |= {as_port(m["alertmanager_port"]) for m in monitoring if m.get("alertmanager_port") is not None}
    # A port that is vLLM's own on some host stays open to it (the rule matches ports, not hosts).
    denied -= own
    return {"groups": groups, "rules": rules, "vllm_egress_denied": sorted(denied)}


def _port_items(field, ports):
    """TCP ports and "low-high" ranges as nft elements (strings); anything else is an InputError naming field."""
    check_type(field, ports, list)
    out = []
    for idx, item in enumerate(ports):
        where = f"{field}[{idx}]"
        text = str(item).strip() if not isinstance(item, bool) else ""
        low, _sep, high = text.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or not 1 <= int(low) <= int(high or low) <= 65535:
            raise InputError(f"{where}: {short(item)} is not a TCP port or range; use an integer in 1..65535 or "
                             "\"low-high\"")
        out.append(f"{int(low)}-{int(high)}" if high and high != low else str(int(low)))
    return sorted(set(out), key=lambda p: (int(p.split("-")[0]), p))


def _as_list(field, value):
    """value as a list (a tuple default is one); anything else is an InputError naming field."""
    return list(value) if isinstance(value, tuple) else check_type(field, value, list)


def _sources(field, values):
    return check_list(field, _as_list(field, values), check_address)


def _rule(name, service, ports, sources, *, anywhere=False):
    return {"name": name, "service": service, "ports": ports, "anywhere": anywhere,
            "v4": [a for a in sources if ":" not in a], "v6": [a for a in sources if ":" in a]}


def _check_matrix(firewall):
    if not isinstance(firewall, dict) or not isinstance(firewall.get("rules"), dict):
        raise InputError("pd_cluster.firewall: no port matrix; run the role through a playbook that imports "
                         "playbooks/validate.yml first (it publishes pd_cluster)")


def host_ruleset(firewall, host, *, extra_peers=(), ssh_ports=(22,), ssh_sources=(), router_clients=(),
                 operator_sources=(), client_ports=(), extra_ports=(), peer_port_ranges=()):
    """One host's accept rules, in order: [{name, service, ports (nft elements), anywhere, v4, v6}].

    firewall: the cluster view's firewall (firewall_matrix, with the view's problems). Every address and port is
    checked here (InputError naming the variable and the fix); the pd_firewall role renders the result.
    extra_peers reach every service of the host (the control node, a bastion); router_clients add to the front
    door, operator_sources to Prometheus / Alertmanager; client_ports [{port, sources}] are further client-facing
    ports; extra_ports further exporters (from the monitoring hosts); peer_port_ranges UCX's TCP ports (vLLM hosts).
    """
    _check_matrix(firewall)
    if firewall.get("problems"):
        raise InputError("; ".join(firewall["problems"]))
    extra = _sources("pd_firewall_extra_peers", extra_peers)
    ssh = _sources("pd_firewall_ssh_sources", ssh_sources)
    clients = _sources("pd_firewall_router_clients", router_clients)
    operators = _sources("pd_firewall_operator_sources", operator_sources)
    groups = firewall.get("groups") or {}

    def union(*lists):
        return sorted({a for lst in lists for a in lst})

    ssh_ports = _port_items("pd_firewall_ssh_ports", _as_list("pd_firewall_ssh_ports", ssh_ports))
    rules = [_rule("ssh", "ssh", ssh_ports, ssh, anywhere=not ssh)]
    view_rules = firewall["rules"].get(host, [])
    for r in view_rules:
        add = clients if r["service"] == "frontdoor" else operators if r["service"] in ("prometheus",
                                                                                        "alertmanager") else []
        rules.append(_rule(r["service"], r["service"], _port_items(f"pd_cluster.firewall {r['service']}", r["ports"]),
                           union(r["sources"], extra, add)))
    if any(r["service"].startswith("nixl_side_channel") for r in view_rules):
        ranges = _port_items("pd_firewall_peer_port_ranges",
                             _as_list("pd_firewall_peer_port_ranges", peer_port_ranges))
        if ranges:
            rules.append(_rule("ucx_tcp", "ucx_tcp", ranges, union(groups.get("vllm", []), extra)))
    ports = _port_items("pd_firewall_extra_ports", _as_list("pd_firewall_extra_ports", extra_ports))
    if ports:
        rules.append(_rule("extra_exporters", "extra_exporters", ports, union(groups.get("monitoring", []), extra)))
    for idx, entry in enumerate(_as_list("pd_firewall_client_ports", client_ports)):
        field = f"pd_firewall_client_ports[{idx}]"
        if not isinstance(entry, dict) or "port" not in entry:
            raise InputError(f"{field}: {short(entry)} is not a {{port, sources}} mapping; give each client port "
                             "as {port: <int>, sources: [IPs/CIDRs]}")
        port = _port_items(f"{field}.port", [entry["port"]])
        rules.append(_rule(f"client_{idx}", f"client port {port[0]}", port,
                           union(_sources(f"{field}.sources", entry.get("sources") or []), extra)))
    return rules


def vllm_egress(firewall, host):
    """The ports a vLLM process of host may not connect to, anywhere, loopback included (nft elements; [] on a host
    without vLLM instances): every service port of the cluster's matrix that is not vLLM's own."""
    _check_matrix(firewall)
    if not any(r["service"] == "vllm_http" for r in firewall["rules"].get(host, [])):
        return []
    return _port_items("pd_cluster.firewall vllm_egress_denied", firewall.get("vllm_egress_denied") or [])


def firewall_digest(nft_json):
    """The digest the loaded table carries (the comment of its rule `pd_firewall sha256:<hex>`), from the output of
    `nft -j list table inet pd_firewall`; "" when the table is absent, unreadable or carries none."""
    try:
        items = json.loads(nft_json or "").get("nftables") or []
    except (ValueError, AttributeError):
        return ""
    for item in items:
        comment = ((item or {}).get("rule") or {}).get("comment") or ""
        if isinstance(comment, str) and comment.startswith(DIGEST_PREFIX):
            return comment[len(DIGEST_PREFIX):]
    return ""
