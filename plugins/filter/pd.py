# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The collection's filters, in one place: each is a plain function in plugins/plugin_utils/ (unit-tested there);
a ValueError it raises (PdFilterError and the validators' ValueErrors) reaches the play as AnsibleFilterError with
the same message, which names the field and the fix."""

from __future__ import annotations

import functools

from ansible.errors import AnsibleFilterError
from ansible_collections.b300.pd.plugins.module_utils import pd_topology_ports
from ansible_collections.b300.pd.plugins.plugin_utils import (
    pd_frontdoor,
    pd_inputs,
    pd_rollout,
    pd_router,
    vllm_install,
)


def _as_filter_error(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise AnsibleFilterError(str(e)) from e

    return inner


_FILTERS = {
    "pd_frontdoor_backends": pd_frontdoor.pd_frontdoor_backends,
    "pd_frontdoor_keys": pd_frontdoor.pd_frontdoor_keys,
    "pd_frontdoor_key_map": pd_frontdoor.pd_frontdoor_key_map,
    "pd_frontdoor_admission": pd_frontdoor.pd_frontdoor_admission,
    "pd_frontdoor_tls_sans": pd_frontdoor.pd_frontdoor_tls_sans,
    "pd_frontdoor_key_transport": pd_frontdoor.pd_frontdoor_key_transport,
    "pd_firewall_rules": pd_topology_ports.host_ruleset,
    "pd_listen_address": pd_inputs.pd_listen_address,
    "pd_firewall_live_digest": pd_topology_ports.firewall_digest,
    "pd_firewall_vllm_egress": pd_topology_ports.vllm_egress,
    "pd_rollout_topology": pd_rollout.pd_rollout_topology,
    "pd_rollout_order": pd_rollout.pd_rollout_order,
    "pd_rollout_routing": pd_rollout.pd_rollout_routing,
    "pd_rollout_routing_mode": pd_rollout.pd_rollout_routing_mode,
    "pd_rollout_keys": pd_rollout.pd_rollout_keys,
    "pd_rollout_metric_sum": pd_rollout.pd_rollout_metric_sum,
    "pd_rollout_never_deployed": pd_rollout.pd_rollout_never_deployed,
    "pd_rollout_partner": pd_rollout.pd_rollout_partner,
    "pd_rollout_queue": pd_rollout.pd_rollout_queue,
    "pd_router_workers": pd_router.pd_router_workers,
    "pd_router_argv": pd_router.pd_router_argv,
    "pd_router_units": pd_router.pd_router_units,
    "pd_router_registry": pd_router.pd_router_registry,
    "pd_router_quote": pd_router.pd_router_quote,
    "vllm_install_venv_name": vllm_install.venv_name,
    "vllm_install_pip_source_args": vllm_install.pip_source_args,
    "vllm_install_lock_problems": vllm_install.lock_problems,
}


class FilterModule:
    """b300.pd filters (used as b300.pd.<name>)."""

    def filters(self):
        return {name: _as_filter_error(fn) for name, fn in _FILTERS.items()}
