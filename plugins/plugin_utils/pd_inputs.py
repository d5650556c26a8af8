# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Inventory values checked again where a template writes them (issue 32): the rules of
plugins/module_utils/pd_input_rules.py, which playbooks/validate.yml applies first, as filters.

``pd_listen_address(host, port, field, port_field)`` -> "host:port" ("[v6]:port" for an IPv6 address) for a
daemon's listen flag; an address that is not an IP or DNS name (a space, a quote, a port of its own) is refused
naming field, a port that is not one naming port_field.
"""

from __future__ import annotations

import ipaddress

from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import InputError, check_host
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_values import as_port


def pd_listen_address(host, port, field="listen address", port_field="port"):
    host = check_host(field, host)
    port = as_port(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InputError(f"{port_field}: {port!r} is not a TCP port; use an integer in 1..65535")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"
