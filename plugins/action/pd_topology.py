# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin of b300.pd.pd_topology: gathers the module's inputs from the inventory, then runs the module.

Each option the task leaves out (hosts, recipe, sla, services, inventory) comes from the play's groups and hostvars
(plugins/module_utils/pd_cluster_inputs.py, whose lists VIEW_VARS / LISTENERS / RECIPE_KEYS are the only copies) and,
for the vars a host does not set, from the owning roles' defaults/main.yml in this collection. bench/pd_cluster.py
composes the view from the same VIEW_VARS, so the playbook's pd_cluster and bench's cannot disagree.

The module itself stays pure and runs as before (check mode included); the result gains `inputs` (the hosts and
recipe it checked) for the tasks after it.
"""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_inputs import topology_args
from ansible_collections.b300.pd.plugins.plugin_utils.pd_role_defaults import role_defaults


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        gathered = topology_args(task_vars.get("groups") or {}, task_vars.get("hostvars") or {}, role_defaults())
        module_args = {**gathered, **self._task.args}  # what the task gives wins
        result.update(self._execute_module(module_name="b300.pd.pd_topology", module_args=module_args,
                                           task_vars=task_vars))
        result["inputs"] = {"hosts": module_args["hosts"], "recipe": module_args["recipe"]}
        return result
