# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Validation of the inventory outside the vLLM topology (issue 32): router, front door, firewall and Alertmanager
vars whose values are written into a unit's ExecStart, an nginx / nft / env file or a command line, and the
addresses of the hosts without vLLM instances. validate_inventory() checks the values the inventory sets (a role's
own default is the collection's and not re-checked); each writer (the pd_router filters, the firewall, the front
door's upstreams) refuses them again with the same rules (pd_input_rules). The vLLM topology is pd_topology's."""

from __future__ import annotations

import re

from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import (
    InputError,
    check_abs_path,
    check_address,
    check_host,
    check_list,
    check_name,
    check_strings,
    check_type,
    problems_of,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import (
    check_text as check_line,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_values import short

ROUTER_FLAG_RE = re.compile(r"\A[a-z0-9][a-z0-9-]*\Z")
ROUTER_UNIT_NAME_RE = re.compile(r"\Avllm-router[a-z0-9-]{0,52}\Z")
# Flags the pd_router role renders from its own variables (plugins/plugin_utils/pd_router.py), never from
# pd_router_extra_args. api-key: the workers' key reaches the router from a systemd credential, never argv.
ROUTER_OWNED_FLAGS = frozenset({
    "vllm-pd-disaggregation", "prefill", "decode", "host", "port", "prometheus-host", "prometheus-port",
    "policy", "prefill-policy", "decode-policy", "kv-connector", "api-key", "health-failure-threshold",
    "health-success-threshold", "health-check-timeout-secs", "health-check-interval-secs",
    "health-check-endpoint", "retry-max-retries", "retry-initial-backoff-ms", "retry-max-backoff-ms",
    "request-timeout-secs", "queue-timeout-secs", "worker-startup-timeout-secs",
    "worker-startup-check-interval", "log-level", "worker-urls", "enable-igw",
})


def check_router_extra_args(field, value):
    """pd_router_extra_args: flag name (leading dashes optional) -> value; no control character at any depth."""
    check_type(field, value, dict)
    for flag, item in value.items():
        check_type(f"{field} (flag {short(flag)})", flag, str)
        if not ROUTER_FLAG_RE.match(flag.lstrip("-")):
            raise InputError(f"{field}: flag {short(flag)} is not a long option name; use lowercase letters, digits "
                             "and '-' (e.g. max-payload-size: 1048576)")
        if flag.lstrip("-") in ROUTER_OWNED_FLAGS:  # before its value is looked at: the value is never shown
            raise InputError(f"{field} sets '--{flag.lstrip('-')}', which the role renders from its own variable; "
                             "remove it from pd_router_extra_args and set the pd_router_ variable instead")
        check_strings(f"{field}.{flag}", item)
    return value


def check_router_unit_names(field, value):
    """The names of pd_router_units (each becomes <name>.service); the rest of each unit is the cluster view's."""
    for idx, unit in enumerate(value if isinstance(value, list) else []):
        name = unit.get("name") if isinstance(unit, dict) else None
        if isinstance(name, str) and not (ROUTER_UNIT_NAME_RE.match(name) and check_name(f"{field}[{idx}].name", name)):
            raise InputError(f"{field}[{idx}].name: {short(name)} is not a router unit name; use 'vllm-router' "
                             "followed by a-z, 0-9 and '-' (e.g. vllm-router-2): it becomes the systemd unit name")
    return value


def check_receivers(field, value):
    """observability_alertmanager_receivers: a list of mappings with a name; the value of a string that fails is
    not shown (a webhook URL or a password may be in it)."""
    check_type(field, value, list)
    for idx, receiver in enumerate(value):
        check_type(f"{field}[{idx}]", receiver, dict)
        check_type(f"{field}[{idx}].name", receiver.get("name"), str)
        try:
            check_strings(f"{field}[{idx}]", receiver)
        except InputError as err:
            where = str(err).split(": ", 1)[0]
            raise InputError(f"{where}: contains a control character (the value is not shown: it may hold a "
                             "credential); it would split the line it is written to: remove it") from None
    return value


def _addresses(field, value):
    return check_list(field, value, check_address)


def _texts(field, value):
    return check_list(field, value, check_line)


# (group whose hosts read it, var, check).
INVENTORY_RULES = (
    ("all", "pd_firewall_host_addresses", _addresses),
    ("all", "pd_firewall_extra_peers", _addresses),
    ("all", "pd_firewall_ssh_sources", _addresses),
    ("all", "pd_firewall_router_clients", _addresses),
    ("all", "pd_firewall_operator_sources", _addresses),
    ("router_hosts", "pd_router_bind_host", check_host),
    ("router_hosts", "pd_router_metrics_bind_host", check_host),
    ("router_hosts", "pd_router_extra_args", check_router_extra_args),
    ("router_hosts", "pd_router_units", check_router_unit_names),
    ("router_hosts", "pd_router_kv_connector", check_line),
    ("router_hosts", "pd_router_policy", check_line),
    ("router_hosts", "pd_router_prefill_policy", check_line),
    ("router_hosts", "pd_router_decode_policy", check_line),
    ("router_hosts", "pd_router_log_level", check_line),
    ("router_hosts", "pd_router_health_check_endpoint", check_line),
    # Written into the router units (User=, Group=, ExecStart=, LoadCredential=, Description=) by the templates.
    ("router_hosts", "pd_router_user", check_name),
    ("router_hosts", "pd_router_group", check_name),
    ("router_hosts", "pd_router_version", check_name),
    ("router_hosts", "pd_router_prefix", check_abs_path),
    ("router_hosts", "pd_router_config_dir", check_abs_path),
    ("router_hosts", "pd_frontdoor_bind_host", check_host),
    ("router_hosts", "pd_frontdoor_metrics_bind_host", check_host),
    ("router_hosts", "pd_frontdoor_access_log", check_abs_path),
    ("router_hosts", "pd_frontdoor_config_dir", check_abs_path),
    ("router_hosts", "pd_frontdoor_client_max_body_size", check_line),
    ("router_hosts", "pd_frontdoor_body_buffer_size", check_line),
    ("monitoring_hosts", "observability_alertmanager_listen_address", check_host),
    ("monitoring_hosts", "observability_alertmanager_receivers", check_receivers),
    ("monitoring_hosts", "observability_alertmanager_default_receiver", check_line),
    ("monitoring_hosts", "observability_alertmanager_critical_receiver", check_line),
    ("monitoring_hosts", "observability_alertmanager_group_by", _texts),
    ("monitoring_hosts", "observability_alertmanager_resolve_timeout", check_line),
    ("monitoring_hosts", "observability_alertmanager_group_wait", check_line),
    ("monitoring_hosts", "observability_alertmanager_group_interval", check_line),
    ("monitoring_hosts", "observability_alertmanager_repeat_interval", check_line),
    ("monitoring_hosts", "observability_alertmanager_critical_repeat_interval", check_line),
)
# What plugins/action/pd_topology.py gathers for validate_inventory (besides ansible_host).
INVENTORY_VARS = ("ansible_host", *dict.fromkeys(var for _group, var, _check in INVENTORY_RULES))


def validate_inventory(groups, hostvars):
    """Problems of the INVENTORY_RULES vars and of the addresses of the hosts without vLLM instances (a vLLM host's
    ansible_host is validate_topology's). groups: group -> hosts; hostvars: host -> the INVENTORY_VARS it sets (a
    null counts as unset). One line per problem; a value set for several hosts (group_vars) is named once."""
    groups = groups if isinstance(groups, dict) else {}
    hostvars = hostvars if isinstance(hostvars, dict) else {}
    found = {}  # problem -> hosts, in order
    vllm_hosts = set(groups.get("vllm_hosts") or [])
    for host in groups.get("all") or []:
        own = hostvars.get(host) or {}
        if host not in vllm_hosts:
            # The address others reach it at: a front door's upstream, a Prometheus target, a firewall peer.
            address = own.get("ansible_host")
            field = "ansible_host" if address is not None else "ansible_host (unset: the inventory name is used)"
            for line in problems_of(check_host, field, host if address is None else address):
                found.setdefault(line, []).append(host)
    for group, var, check in INVENTORY_RULES:
        for host in groups.get(group) or []:
            value = (hostvars.get(host) or {}).get(var)
            for line in [] if value is None else problems_of(check, var, value):
                if host not in found.setdefault(line, []):
                    found[line].append(host)
    return [f"host {', '.join(str(h) for h in hosts)}, field {line}" for line, hosts in found.items()]
