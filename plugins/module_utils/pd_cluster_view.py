# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The cluster view: every address, URL and port set the roles, verify, bench and tests use, composed here once.

view_inputs(groups, hostvars, defaults) turns raw inventory data into cluster_view's input; cluster_view() composes
the view of a topology that pd_topology.validate_topology() accepted. playbooks/validate.yml publishes it as
pd_cluster (plugins/action/pd_topology.py gathers the inventory data), bench/pd_cluster.py loads the same.
"""

from __future__ import annotations

from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import POOLS
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_ports import firewall_addresses, firewall_matrix
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_values import (
    MIN_UNPRIVILEGED_PORT,
    as_port,
    is_int,
    short,
)

# The inventory vars the view reads, per host (hostvars) and, where a host does not set them, from the role that
# owns them (defaults/main.yml): var -> role.
VIEW_VARS = {
    "ansible_host": None,
    "pd_instances": None,
    "pd_firewall_host_addresses": None,
    "pd_router_port": "pd_router",
    "pd_router_units": "pd_router",
    "pd_router_bind_host": "pd_router",
    "pd_frontdoor_metrics_port": "pd_frontdoor",
    "pd_frontdoor_tls_enabled": "pd_frontdoor",
    "pd_frontdoor_tls_certificate": "pd_frontdoor",
    "pd_frontdoor_tls_client_ca": "pd_frontdoor",
    "pd_control_dir": None,
    "observability_prometheus_port": "observability",
    "observability_alertmanager_enabled": "observability",
    "observability_alertmanager_port": "observability",
    "observability_alertmanager_listen_address": "observability",
    "observability_dcgm_exporter_port": "observability",
    "node_exporter_port": "node_exporter",
}
ROUTER_UNIT_MODES = ("pd", "colocated")
_LOOPBACK_PREFIXES = ("127.", "localhost", "::1")


class TopologyError(ValueError):
    """The router / monitoring input of the cluster view is unusable; one line per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _truthy(value):
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "on", "1")
    return bool(value)


def _url(address, port, scheme="http"):
    host = f"[{address}]" if ":" in str(address) else address
    return f"{scheme}://{host}:{port}"


# Where the pd_frontdoor role keeps the bundle-made CA on the control node (under pd_control_dir).
FRONTDOOR_CA_SUBPATH = ".cache/tls/ca.crt"


def frontdoor_tls(enabled, certificate="", client_ca="", control_dir=None):
    """A front door's scheme and the CA file (on the control node) its clients trust, from the pd_frontdoor TLS vars:
    TLS off -> http, no CA; pd_frontdoor_tls_client_ca given -> that file; no certificate given (the bundle makes
    one) -> the bundle's CA under pd_control_dir; an operator's certificate without a CA -> None (the system's)."""
    if not _truthy(True if enabled is None else enabled):
        return {"scheme": "http", "ca_file": None}
    if client_ca:
        return {"scheme": "https", "ca_file": str(client_ca)}
    if not certificate and control_dir:
        return {"scheme": "https", "ca_file": f"{str(control_dir).rstrip('/')}/{FRONTDOOR_CA_SUBPATH}"}
    return {"scheme": "https", "ca_file": None}


def _alertmanager_api(mon):
    """The Alertmanager API as its own host reaches it ({host, url}; None where none is deployed): the role's default
    listener is loopback only (observability_alertmanager_listen_address), so callers run there (delegate_to host);
    a wildcard listener answers on loopback too."""
    if not mon or mon.get("alertmanager_port") is None:
        return None
    listen = str(mon.get("alertmanager_listen_address") or "")
    local = listen in ("", "0.0.0.0", "::") or listen.startswith(_LOOPBACK_PREFIXES)  # noqa: S104 (a comparison: a wildcard listener)
    return {"host": mon["host"], "url": _url("127.0.0.1" if local else listen, as_port(mon["alertmanager_port"]))}


def view_inputs(groups, hostvars, defaults):
    """The view's input from raw inventory data: groups (name -> hosts, inventory order), hostvars (host -> the
    VIEW_VARS it sets) and defaults (role -> its defaults/main.yml). Returns (hosts, routers, monitoring, peers):
    hosts is validate_topology's input (vLLM hosts), the others as cluster_view takes them."""
    groups = groups or {}
    hostvars = hostvars or {}

    def var(host, name):
        hv = hostvars.get(host) or {}
        if name in hv and hv[name] is not None:
            return hv[name]
        role = VIEW_VARS.get(name)
        return ((defaults or {}).get(role) or {}).get(name) if role else None

    def address(host):
        return var(host, "ansible_host") or host

    hosts = {h: {"ansible_host": var(h, "ansible_host"), "pd_instances": var(h, "pd_instances"),
                 "node_exporter_port": var(h, "node_exporter_port")}
             for h in groups.get("vllm_hosts") or []}
    routers = [{"host": h, "address": address(h), "client_port": var(h, "pd_router_port"),
                "bind_host": var(h, "pd_router_bind_host"), "units": var(h, "pd_router_units"),
                "frontdoor_metrics_port": var(h, "pd_frontdoor_metrics_port"),
                "frontdoor_tls": frontdoor_tls(var(h, "pd_frontdoor_tls_enabled"),
                                               var(h, "pd_frontdoor_tls_certificate"),
                                               var(h, "pd_frontdoor_tls_client_ca"), var(h, "pd_control_dir")),
                "node_exporter_port": var(h, "node_exporter_port")}
               for h in groups.get("router_hosts") or []]
    monitoring = [{"host": h, "address": address(h), "prometheus_port": var(h, "observability_prometheus_port"),
                   "alertmanager_port": (var(h, "observability_alertmanager_port")
                                         if _truthy(var(h, "observability_alertmanager_enabled")) else None),
                   "alertmanager_listen_address": var(h, "observability_alertmanager_listen_address"),
                   "dcgm_exporter_port": var(h, "observability_dcgm_exporter_port")}
                  for h in groups.get("monitoring_hosts") or []]
    # Where each inventory host connects from: its ansible_host and pd_firewall_host_addresses, as set (checked by
    # cluster_view: a wrong type is a problem naming the field, never a traceback here).
    peers = {h: {"ansible_host": var(h, "ansible_host"),
                 "pd_firewall_host_addresses": var(h, "pd_firewall_host_addresses")}
             for h in groups.get("all") or []}
    for m in monitoring:
        m["node_exporter_port"] = var(m["host"], "node_exporter_port")
    return hosts, routers, monitoring, peers


def _check_router(problems, router):
    host = router.get("host")
    where = f"router host {host}"
    units = router.get("units")
    if not isinstance(units, list) or not units:
        problems.append(f"{where}, field pd_router_units: missing or empty; list its router units (group_vars/all/"
                        "router.yml, see roles/pd_router/defaults/main.yml)")
        return
    for idx, unit in enumerate(units):
        if not isinstance(unit, dict):
            problems.append(f"{where}, field pd_router_units[{idx}]: {short(unit)} is not a mapping of name, mode, "
                            "port, metrics_port")
            continue
        if not isinstance(unit.get("name"), str) or not unit.get("name"):
            problems.append(f"{where}, field pd_router_units[{idx}].name: missing; name the unit (vllm-router...)")
        if unit.get("mode") not in ROUTER_UNIT_MODES:
            problems.append(f"{where}, field pd_router_units[{idx}].mode: {short(unit.get('mode'))} is not a mode; "
                            "use pd or colocated")
        for field in ("port", "metrics_port"):
            port = as_port(unit.get(field))
            if not is_int(port) or not MIN_UNPRIVILEGED_PORT <= port <= 65535:
                # the router units run as an unprivileged user without capabilities: no port below 1024
                problems.append(f"{where}, field pd_router_units[{idx}].{field}: {short(unit.get(field))} is not a "
                                "port the unprivileged router can listen on; use an integer in 1024..65535")
    if not any(isinstance(u, dict) and u.get("mode") == "pd" for u in units):
        problems.append(f"{where}, field pd_router_units: no unit with mode: pd; a router host needs a P/D router")
    for field in ("client_port", "frontdoor_metrics_port"):
        port = as_port(router.get(field))
        if not is_int(port) or not 1 <= port <= 65535:
            # nginx binds as root: a front door on 443 is fine
            name = "pd_router_port" if field == "client_port" else "pd_frontdoor_metrics_port"
            problems.append(f"{where}, field {name}: {short(router.get(field))} is not a TCP port; use an integer "
                            "in 1..65535")


def cluster_view(hosts, routers=(), monitoring=(), peers=()):
    """The normalized cluster view (JSON-able) of a topology that validate_topology() accepted.

    hosts: validate_topology's vLLM hosts (host -> {ansible_host, pd_instances, node_exporter_port}), inventory
    order. routers: [{host, address, client_port, bind_host, units, frontdoor_metrics_port, node_exporter_port,
    frontdoor_tls ({scheme, ca_file}, frontdoor_tls(); left out: http)}].
    monitoring: [{host, address, prometheus_port, alertmanager_port (None: not deployed),
    alertmanager_listen_address, dcgm_exporter_port}].
    peers: host -> {ansible_host, pd_firewall_host_addresses} (where each host connects from: the firewall's port
    matrix), or a plain list of addresses (then each host connects from its address). view_inputs() builds all
    four from the inventory. Raises TopologyError when the router input or pd_firewall_host_addresses is unusable.
    """
    problems = []
    for router in routers:
        _check_router(problems, router)
    addresses, unmatched = _firewall_addresses(problems, hosts, routers, monitoring, peers)
    if problems:
        raise TopologyError(problems)

    instances, pools = [], {p: [] for p in POOLS}
    firewall = {}
    for host, hv in hosts.items():
        address = hv.get("ansible_host") or host
        ports = []
        for inst in hv.get("pd_instances") or []:
            dp = inst.get("dp_size") or 1
            side = [inst["nixl_side_channel_port"] + r for r in range(dp)]
            entry = {"name": inst["name"], "host": host, "address": address, "pool": inst["pool"],
                     "http_port": inst["http_port"], "url": _url(address, inst["http_port"]),
                     "nixl_side_channel_port": inst["nixl_side_channel_port"], "nixl_side_channel_ports": side,
                     "dp_rpc_port": inst.get("dp_rpc_port")}
            instances.append(entry)
            pools[inst["pool"]].append(inst["name"])
            ports += [inst["http_port"], *side] + ([inst["dp_rpc_port"]] if inst.get("dp_rpc_port") is not None
                                                   else [])
        firewall[host] = {"instance_ports": sorted(set(ports)), "router_ports": [], "client_ports": []}

    view_routers, pd_router_urls = [], []
    for idx, r in enumerate(routers):
        units = [{"name": u["name"], "mode": u["mode"], "port": as_port(u["port"]),
                  "metrics_port": as_port(u["metrics_port"]), "url": _url(r["address"], as_port(u["port"]))}
                 for u in r["units"]]
        client_port = as_port(r["client_port"])
        # The front door's scheme and the CA its clients trust (https on b300 by default, issue #32).
        tls = r.get("frontdoor_tls") or {"scheme": "http", "ca_file": None}
        view_routers.append({"host": r["host"], "address": r["address"], "client_port": client_port,
                             "url": _url(r["address"], client_port, tls["scheme"]), "scheme": tls["scheme"],
                             "ca_file": tls["ca_file"], "bind_host": r.get("bind_host"),
                             "frontdoor_metrics_port": as_port(r["frontdoor_metrics_port"]), "units": units})
        # The P/D router units as the first router host reaches them (its own on loopback): pd_rollout's registry
        # tool runs there and drains every P/D router.
        pd_router_urls += [_url("127.0.0.1" if idx == 0 else r["address"], u["port"])
                           for u in units if u["mode"] == "pd"]
        fw = firewall.setdefault(r["host"], {"instance_ports": [], "router_ports": [], "client_ports": []})
        fw["router_ports"] = sorted({as_port(r["frontdoor_metrics_port"])} | {u["port"] for u in units}
                                    | {u["metrics_port"] for u in units})
        fw["client_ports"] = [client_port]
    for m in monitoring:
        firewall.setdefault(m["host"], {"instance_ports": [], "router_ports": [], "client_ports": []})

    node_hosts = list(hosts) + [r["host"] for r in routers if r["host"] not in hosts]
    node_port = {h: hv.get("node_exporter_port") for h, hv in hosts.items()}
    for r in routers:
        node_port.setdefault(r["host"], r.get("node_exporter_port"))
    address_of = {h: (hv.get("ansible_host") or h) for h, hv in hosts.items()}
    for r in routers:
        address_of.setdefault(r["host"], r["address"])
    dcgm_port = as_port(monitoring[0].get("dcgm_exporter_port")) if monitoring else None
    targets = {
        "vllm": [{"target": f"{i['address']}:{i['http_port']}",
                  "labels": {"pool": i["pool"], "instance_name": i["name"], "host": i["host"]}} for i in instances],
        "pd-router": [{"target": f"{r['address']}:{u['metrics_port']}",
                       "labels": {"host": r["host"], "router_unit": u["name"], "router_mode": u["mode"]}}
                      for r in view_routers for u in r["units"]],
        "pd-frontdoor": [{"target": f"{r['address']}:{r['frontdoor_metrics_port']}", "labels": {"host": r["host"]}}
                         for r in view_routers],
        "node": [{"target": f"{address_of[h]}:{as_port(node_port[h])}",
                  "labels": {"host": h, "vllm_host": "true" if hosts.get(h, {}).get("pd_instances") else "false"}}
                 for h in node_hosts],
        "dcgm": [{"target": f"{address_of[h]}:{dcgm_port}", "labels": {"host": h}} for h in hosts],
    }
    first_mon = monitoring[0] if monitoring else None
    matrix = firewall_matrix(addresses, {h: [i for i in instances if i["host"] == h] for h in hosts}, view_routers,
                             [dict(m, prometheus_port=as_port(m.get("prometheus_port")),
                                   alertmanager_port=as_port(m.get("alertmanager_port"))) for m in monitoring],
                             exporters={**{m["host"]: m.get("node_exporter_port") for m in monitoring},
                                        **{h: node_port[h] for h in node_hosts}},
                             dcgm_port=dcgm_port)
    return {
        "instances": instances,
        "pools": pools,
        "routers": view_routers,
        "router_url": view_routers[0]["url"] if view_routers else None,
        "router_ca_file": view_routers[0]["ca_file"] if view_routers else None,
        "pd_router_urls": pd_router_urls,
        # The one host pd_rollout's registry tool runs on (pd_router_urls are as it reaches them) and the dead-worker
        # watcher with it: the watcher must respect the wanted list that `set --state` writes there.
        "registry_host": view_routers[0]["host"] if view_routers else None,
        "prometheus_url": _url(first_mon["address"], as_port(first_mon["prometheus_port"])) if first_mon else None,
        "alertmanager": _alertmanager_api(first_mon),
        "prometheus_targets": targets,
        # peers: every address of the matrix (kept for tools that list the cluster's addresses); rules: host ->
        # [{service, ports, from, sources}] (pd_topology_ports.firewall_matrix), what pd_firewall renders.
        "firewall": {"peers": sorted({a for lst in addresses.values() for a in lst}), "hosts": firewall,
                     "groups": matrix["groups"], "rules": matrix["rules"],
                     "vllm_egress_denied": matrix["vllm_egress_denied"], "problems": unmatched},
    }


def _firewall_addresses(problems, hosts, routers, monitoring, peers):
    """(host -> [addresses it connects from], [firewall problems]) for the port matrix; problems of
    pd_firewall_host_addresses are added to problems (the topology is refused)."""
    address_of = {h: hv.get("ansible_host") for h, hv in hosts.items()}
    for r in list(routers) + list(monitoring):
        address_of.setdefault(r["host"], r.get("address"))
    addresses, unmatched = {}, []
    if isinstance(peers, dict):
        for host, given in peers.items():
            spec = given if isinstance(given, dict) else {}
            addresses[host], bad = firewall_addresses(problems, host, spec.get("ansible_host"),
                                                      spec.get("pd_firewall_host_addresses"))
            unmatched += bad
    else:  # a plain list of peers: each host connects from its address (when it is an IP)
        for host, address in address_of.items():
            addresses[host], _extra = firewall_addresses(problems, host, address, None)
    return addresses, unmatched
