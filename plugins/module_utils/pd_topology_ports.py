# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The port matrix of each host: every port a vLLM instance (HTTP, NIXL side-channel range, DP RPC) or one of the
bundle's other listeners (router API and metrics, Prometheus, node exporter: `services`) claims, and the clashes."""

from __future__ import annotations

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
