# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin of b300.pd.pd_topology: gathers the module's inputs from the inventory, then runs the module.

Each option the task leaves out (hosts, recipe, sla, services, inventory) comes from the play's groups and hostvars
(plugins/module_utils/pd_cluster_inputs.py, whose lists VIEW_VARS / LISTENERS / RECIPE_KEYS are the only copies) and,
for the vars a host does not set, from the owning roles' defaults/main.yml in this collection. bench/pd_cluster.py
composes the view from the same VIEW_VARS, so the playbook's pd_cluster and bench's cannot disagree.

The module itself stays pure and runs as before (check mode included); the result gains `inputs` (the hosts and
recipe it checked) for the tasks after it.

The inventory outside the topology (router, front door, firewall, Alertmanager vars and the addresses of the hosts
without vLLM instances: pd_inventory_rules.validate_inventory) is checked here, with the same shared rules as the
writers; its problems join the module's in one failure, and the cluster view is then not composed from the refused
values.
"""

from __future__ import annotations

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_inputs import inventory_values, topology_args
from ansible_collections.b300.pd.plugins.module_utils.pd_inventory_rules import INVENTORY_VARS, validate_inventory
from ansible_collections.b300.pd.plugins.plugin_utils.pd_role_defaults import role_defaults


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        groups, hostvars = task_vars.get("groups") or {}, task_vars.get("hostvars") or {}
        gathered = topology_args(groups, hostvars, role_defaults())
        refused = validate_inventory(groups, inventory_values(groups, hostvars, INVENTORY_VARS, skip=(AnsibleError,)))
        module_args = {**gathered, **self._task.args}  # what the task gives wins
        if refused:
            module_args.pop("inventory", None)  # no cluster view of values that are refused
        result.update(self._execute_module(module_name="b300.pd.pd_topology", module_args=module_args,
                                           task_vars=task_vars))
        result["inputs"] = {"hosts": module_args["hosts"], "recipe": module_args["recipe"]}
        if refused:
            # The module's own problems first (or its message, when it failed without them), then the inventory's.
            own = result.get("problems") or ([result["msg"]] if result.get("failed") and result.get("msg") else [])
            problems = [*own, *refused]
            result.pop("cluster", None)
            result.update(failed=True, problems=problems, msg=(
                f"P/D topology invalid ({len(problems)} problem{'s' if len(problems) != 1 else ''}); nothing was "
                "changed:\n" + "\n".join(f"- {p}" for p in problems)))
        return result
