# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the topology check and the cluster view read from the inventory, gathered in one place.

topology_args(groups, hostvars, defaults) -> the pd_topology module's options {hosts, recipe, sla, services,
inventory}. groups: group -> hosts (inventory order); hostvars: host -> its vars (Ansible's hostvars, which
template on access, or plain dicts); defaults: role -> its defaults/main.yml, for each role in VIEW_ROLES.
plugins/action/pd_topology.py calls it with the play's groups and hostvars, so playbooks/validate.yml copies no list.
"""

from __future__ import annotations

from collections.abc import Mapping

from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_view import VIEW_VARS
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import RECIPE_KEYS

# The groups the view is composed from, in the module's O(inventory).
VIEW_GROUPS = ("all", "vllm_hosts", "router_hosts", "monitoring_hosts")
# The roles whose defaults/main.yml hold the value of a view var that a host does not set.
VIEW_ROLES = tuple(sorted({role for role in VIEW_VARS.values() if role}))
# The bundle's other listeners, checked for port clashes with each other and with the instances of their host:
# (group whose hosts run it, the var that sets its port, what listens). The var's default is its owning role's
# (VIEW_VARS), so the two cannot drift.
LISTENERS = (
    ("router_hosts", "pd_router_port", "front door (client port)"),
    ("router_hosts", "pd_frontdoor_metrics_port", "front door metrics"),
    ("monitoring_hosts", "observability_prometheus_port", "Prometheus"),
    ("vllm_hosts", "node_exporter_port", "node exporter"),
    ("router_hosts", "node_exporter_port", "node exporter"),
    ("monitoring_hosts", "node_exporter_port", "node exporter"),
)
# The ports each router unit (an item of pd_router_units) listens on.
ROUTER_UNIT_PORT_FIELDS = ("port", "metrics_port")


def _vars_of(hostvars, host):
    return hostvars.get(host) or {}


def _host_value(hostvars, host, name, defaults):
    """The host's value of a view var (set to null counts as set), else its owning role's default."""
    own = _vars_of(hostvars, host)
    if name in own:
        return own[name]
    return ((defaults or {}).get(VIEW_VARS[name]) or {}).get(name)


def topology_hosts(groups, hostvars):
    """validate_topology's hosts: each vLLM host's ansible_host, pd_gpus_per_host, pd_instances (None where unset,
    so the checks name them) and recipe, its values of the recipe vars (RECIPE_KEYS) it has."""
    hosts = {}
    for host in groups.get("vllm_hosts") or []:
        own = _vars_of(hostvars, host)
        hosts[host] = {"ansible_host": own.get("ansible_host"), "pd_gpus_per_host": own.get("pd_gpus_per_host"),
                       "pd_instances": own.get("pd_instances"),
                       "recipe": {key: own[key] for key in RECIPE_KEYS if key in own}}
    return hosts


def listener_services(groups, hostvars, defaults):
    """validate_topology's services: [{host, field, service, port}] of every LISTENERS entry (once per host and var)
    and every router unit's ports. An unusable pd_router_units adds none; the cluster view names it."""
    services = []
    for group, field, service in LISTENERS:
        for host in groups.get(group) or []:
            item = {"host": host, "field": field, "service": service,
                    "port": _host_value(hostvars, host, field, defaults)}
            if item not in services:
                services.append(item)
    for host in groups.get("router_hosts") or []:
        units = _host_value(hostvars, host, "pd_router_units", defaults)
        for unit in units if isinstance(units, list) else []:
            if not isinstance(unit, Mapping):
                continue
            name = unit["name"] if "name" in unit else "?"
            services += [{"host": host, "field": f"pd_router_units {name} {field}",
                          "service": f"vllm-router {name}", "port": unit[field]}
                         for field in ROUTER_UNIT_PORT_FIELDS if field in unit]
    return services


def view_inventory(groups, hostvars, defaults):
    """The module's O(inventory): the VIEW_GROUPS, each host's own values of the VIEW_VARS, the roles' defaults."""
    return {
        "groups": {name: list(groups.get(name) or []) for name in VIEW_GROUPS},
        "hostvars": {host: {name: own[name] for name in VIEW_VARS if name in own}
                     for host in groups.get("all") or [] for own in [_vars_of(hostvars, host)]},
        "defaults": defaults,
    }


def topology_args(groups, hostvars, defaults):
    """The pd_topology module's options from the inventory: the recipe and pd_sla are the first vLLM host's."""
    # Each host's vars looked up once (Ansible's hostvars compute a host's vars on every lookup).
    hostvars = {host: _vars_of(hostvars, host) for name in VIEW_GROUPS for host in groups.get(name) or []}
    hosts = topology_hosts(groups, hostvars)
    first = next(iter(hosts), None)
    return {
        "hosts": hosts,
        "recipe": hosts[first]["recipe"] if hosts else {},
        "sla": _vars_of(hostvars, first).get("pd_sla") if hosts else None,
        "services": listener_services(groups, hostvars, defaults),
        "inventory": view_inventory(groups, hostvars, defaults),
    }


def plain(value):
    """value with Ansible's tagged types (its str, int, list, dict subclasses) turned into the plain ones, so a
    problem line names the type the inventory wrote (int, not _AnsibleTaggedInt)."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def inventory_values(groups, hostvars, names, skip=()):
    """host -> {name: value} of the names each host of group all sets (validate_inventory's input; a role default is
    not included). skip: the exceptions of a value that cannot be computed yet (Ansible's templating of a var that
    refers to one a later play defines): that value is left out, its writer still checks it."""
    out = {}
    for host in groups.get("all") or []:
        own = _vars_of(hostvars, host)
        values = {}
        for name in names:
            try:
                if name in own:
                    values[name] = plain(own[name])
            except skip:
                continue
        out[host] = values
    return out
