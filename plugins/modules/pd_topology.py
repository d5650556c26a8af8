#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_topology
short_description: Validate the whole P/D topology before any host changes
description:
  - Checks every vLLM host's C(pd_instances), C(pd_gpus_per_host) and C(ansible_host), the recipe vars and
    C(pd_sla) together (like kubespray's validate_inventory). Collects all problems and fails once, one line
    per problem naming host, instance, field and the fix.
  - Runs on the control node and changes nothing.
  - "Checks: missing/unknown fields, pool, unique names, GPU sets (overlap, beyond pd_gpus_per_host, length
    = tp_size*dp_size), HTTP / NIXL side-channel range / DP RPC port collisions on a host (across kinds),
    port numbers, prefill TP <= decode TP, model / block-size / kv-cache-dtype / dtype agreement between
    the pools, both pools present, kv roles (and that each fits its pool), reserved flags, SLA types and
    (finite) ranges."
  - "Checks every string written into a unit or env file (instance and served model names, model path, flag
    and env names and values, C(ucx_net_devices), C(ansible_host)) for control characters; C(ucx_net_devices)
    is a list of RDMA C(device:port); C(max-model-len), C(max-num-batched-tokens) and C(max-num-seqs) are
    positive integers and C(gpu-memory-utilization) is in (0, 1]."
  - "Checks the ports of the bundle's other listeners (O(services): router API and metrics, Prometheus, node
    exporter) against each other and against the instances on the same host."
  - "As a task, every option it leaves out is gathered from the inventory on the control node by the action plugin
    (plugins/action/pd_topology.py, from the play's C(groups) and C(hostvars) and the owning roles' defaults; the
    lists it reads are plugins/module_utils/pd_cluster_inputs.py's), so a playbook passes none of them and copies no
    list of vars."
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  hosts:
    description:
      - Host name -> C({pd_instances, pd_gpus_per_host, ansible_host}); optional C(recipe) key with that
        host's own values of the recipe vars (when group or host vars differ per host).
      - Left out, every host of group C(vllm_hosts) with its values (and its own recipe vars).
    type: dict
  recipe:
    description:
      - The recipe vars (C(pd_vllm_flags_common), C(pd_vllm_flags_pool), C(pd_kv_transfer_config),
        C(pd_kv_roles), C(pd_vllm_env), C(pd_ucx_env), C(pd_model_path), C(pd_served_model_name)).
      - Left out, the first vLLM host's.
    type: dict
  sla:
    description:
      - C(pd_sla) (ttft_mean_s, tpot_mean_ms, context_min_tokens, context_max_tokens).
      - Left out, the first vLLM host's.
    type: dict
  services:
    description:
      - The bundle's other listeners, one item per host and port, checked for clashes with each other and with
        the instances of the same host. C(field) names the inventory var that sets the port, C(service) says
        what listens.
      - Left out, the front door's client and metrics ports and the router units' ports of every router host, the
        Prometheus port of every monitoring host and the node exporter port of each of those and every vLLM host,
        each the host's value
        or its role's default.
    type: list
    elements: dict
  inventory:
    description:
      - What the cluster view (RV(cluster)) is composed from, C({groups, hostvars, defaults}). C(groups) holds
        C(all), C(vllm_hosts), C(router_hosts) and C(monitoring_hosts) in inventory order; C(hostvars) each host's
        own values of the vars the view reads (C(ansible_host), C(pd_instances), C(pd_router_port),
        C(pd_router_units), C(pd_router_bind_host), C(pd_frontdoor_metrics_port), C(observability_prometheus_port),
        C(observability_alertmanager_enabled), C(observability_alertmanager_port),
        C(observability_alertmanager_listen_address), C(observability_dcgm_exporter_port), C(node_exporter_port),
        C(pd_firewall_host_addresses), the VIEW_VARS of plugins/module_utils/pd_cluster_view.py); C(defaults)
        role -> that role's defaults/main.yml, for the vars a host does not set.
      - Left out, gathered from the play's inventory.
    type: dict
extends_documentation_fragment:
  - b300.pd.attributes
  - b300.pd.attributes.info_module
"""

EXAMPLES = r"""
- name: Validate the P/D topology of the inventory and compose the cluster view (every input gathered)
  b300.pd.pd_topology:
  register: topology

- name: Validate a topology given explicitly (the cluster view's inventory, left out, is still gathered)
  b300.pd.pd_topology:
    hosts:
      b300-01:
        ansible_host: 192.0.2.11
        pd_gpus_per_host: 8
        pd_instances: "{{ hostvars['b300-01'].pd_instances }}"
    recipe:
      pd_model_path: "{{ pd_model_path }}"
      pd_served_model_name: "{{ pd_served_model_name }}"
      pd_vllm_flags_common: "{{ pd_vllm_flags_common }}"
      pd_vllm_flags_pool: "{{ pd_vllm_flags_pool }}"
      pd_kv_transfer_config: "{{ pd_kv_transfer_config }}"
      pd_kv_roles: "{{ pd_kv_roles }}"
      pd_vllm_env: "{{ pd_vllm_env }}"
      pd_ucx_env: "{{ pd_ucx_env }}"
    sla: "{{ pd_sla }}"
    services:
      - {host: b300-03, port: 8000, field: pd_router_port, service: P/D router API}
      - {host: b300-03, port: 9100, field: node_exporter_port, service: node exporter}
"""

RETURN = r"""
problems:
  description: One line per problem (empty when valid).
  returned: always
  type: list
  elements: str
inputs:
  description:
    - The O(hosts) and O(recipe) the module checked (gathered or given), for the tasks after it that render the
      same instances (playbooks/validate.yml's vLLM parser check). Added by the action plugin.
  returned: always (as a task)
  type: dict
  sample: {hosts: {b300-01: {ansible_host: 192.0.2.11, pd_gpus_per_host: 8, pd_instances: [], recipe: {}}},
           recipe: {pd_model_path: /mnt/models/glm}}
summary:
  description: Hosts, instances per pool (host/name) and GPUs used.
  returned: always
  type: dict
  sample: {hosts: 3, instances: {prefill: [b300-01/prefill-a], decode: [b300-03/decode-a]}, gpus: 24}
cluster:
  description:
    - The cluster view every role, verify, bench and test reads (playbooks/validate.yml publishes it to every host
      as C(pd_cluster)); composed once, from the validated topology (plugins/module_utils/pd_cluster_view.py).
    - C(instances) (inventory order) each with name, host, address, pool, http_port, url, nixl_side_channel_port,
      nixl_side_channel_ports (one per DP rank), dp_rpc_port; C(pools) pool -> instance names.
    - C(routers) (router_hosts order) each with host, address, client_port, url (its front door, https when
      pd_frontdoor_tls_enabled), scheme, ca_file (the CA clients verify it with, or null), bind_host,
      frontdoor_metrics_port and units (name, mode, port, metrics_port, url).
    - C(router_url) the clients' URL (the first router host's front door); C(router_ca_file) its CA file (null for the
      system's CAs or plain http); C(pd_router_urls) every P/D router unit
      as the first router host reaches it (its own on loopback); C(prometheus_url); C(alertmanager) {host, url}, its
      API as its own host reaches it (loopback for the default listener; null where none is deployed).
    - C(prometheus_targets) job (vllm, pd-router, pd-frontdoor, node, dcgm) -> [{target, labels}].
    - C(firewall) C(peers) (every host's ansible_host and pd_firewall_host_addresses), C(hosts) host ->
      {instance_ports, router_ports, client_ports}, C(groups) (the host sets the port matrix names, vllm, prefill,
      decode, router, monitoring), C(rules) host -> [{service, ports, from, sources}] (the per-service port matrix,
      plugins/module_utils/pd_topology_ports.py) and C(problems) (what the matrix could not place).
    - The inventory checks of issue 32 (pd_inventory_rules.validate_inventory with
      plugins/module_utils/pd_input_rules.py, over the router, front door, firewall and Alertmanager vars and every
      non-vLLM host's address) run in the action plugin and fail the task with the module's own problems.
  returned: when the topology is valid and O(inventory) is given or gathered (always as a task)
  type: dict
  sample:
    router_url: http://10.237.0.13:8000
    router_ca_file: null
    prometheus_url: http://10.237.0.13:9090
    pools: {prefill: [prefill-0], decode: [decode-0]}
    instances:
      - {name: prefill-0, host: pd-prefill-0, address: 10.237.0.11, pool: prefill, http_port: 8100,
         url: "http://10.237.0.11:8100", nixl_side_channel_port: 5600, nixl_side_channel_ports: [5600],
         dp_rpc_port: null}
"""

from ansible.module_utils.basic import AnsibleModule  # noqa: E402 (community.general layout)
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_view import (  # noqa: E402
    TopologyError,
    cluster_view,
    view_inputs,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_topology import summarize, validate_topology  # noqa: E402


def main():
    module = AnsibleModule(
        argument_spec=dict(
            # Not required here: the action plugin fills in each one a task leaves out (a missing one is named by
            # validate_topology when the module runs without its action plugin).
            hosts=dict(type="dict"),
            recipe=dict(type="dict"),
            sla=dict(type="dict"),
            services=dict(type="list", elements="dict"),
            inventory=dict(type="dict"),
        ),
        supports_check_mode=True,
    )
    hosts, recipe, sla = module.params["hosts"], module.params["recipe"], module.params["sla"]
    problems = validate_topology(hosts, recipe, sla, module.params["services"])
    summary = summarize(hosts)
    if problems:
        module.fail_json(
            msg=f"P/D topology invalid ({len(problems)} problem{'s' if len(problems) != 1 else ''}); "
            "nothing was changed:\n" + "\n".join(f"- {p}" for p in problems),
            problems=problems,
            summary=summary,
        )
    result = dict(changed=False, problems=[], summary=summary)
    inventory = module.params["inventory"]
    if inventory is not None:
        # The same hostvars validate_topology just accepted (the action plugin gathers both from hostvars).
        view_hosts, routers, monitoring, peers = view_inputs(inventory.get("groups"), inventory.get("hostvars"),
                                                             inventory.get("defaults"))
        try:
            result["cluster"] = cluster_view(view_hosts, routers, monitoring, peers)
        except TopologyError as exc:
            module.fail_json(
                msg=f"P/D topology invalid ({len(exc.problems)} problem{'s' if len(exc.problems) != 1 else ''}); "
                "nothing was changed:\n" + "\n".join(f"- {p}" for p in exc.problems),
                problems=exc.problems, summary=summary)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
