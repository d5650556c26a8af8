#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_async_job
short_description: One status check of an async job that fails at once when the job has vanished
description:
  - "Reads the results file of an async job started with C(async) and C(poll: 0) (like
    M(ansible.builtin.async_status)) and, while it says started and not finished, checks that a process of
    the job still exists (an argv in C(/proc) with the job's jid and C(async_wrapper))."
  - "A job with no process left and no result has vanished: the module fails with a message naming the host,
    the job and what it was doing. This happens when ansible-core's async_wrapper loses its 2.5 s start-up
    handshake on a loaded host: the module runner dies on a broken pipe and the results file says started
    forever, so M(ansible.builtin.async_status) or C(poll) would wait for the whole async limit."
  - A finished job's result is returned as the task's result (changed, failed, rc, the module's own keys) and
    its results file is removed. A job killed by async_wrapper at its limit fails naming the limit's variable.
  - "Call it in a loop (C(until: result is finished), C(retries), C(delay)); every return carries C(finished)."
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  jid:
    description: "The job id, C(ansible_job_id) of the task started with C(poll: 0)."
    type: str
    required: true
  results_file:
    description: "The job's results file, C(results_file) of the task started with C(poll: 0)."
    type: path
    required: true
  description:
    description: What the job does, for messages (e.g. C(model_weights fetch of revision abc from hf)).
    type: str
    default: async job
  host:
    description: The host's name in messages (give C(inventory_hostname)); default the node name.
    type: str
  limit_var:
    description: The variable that sets the job's async limit, named when async_wrapper killed the job at it.
    type: str
    default: ""
extends_documentation_fragment:
  - b300.pd.attributes
attributes:
  check_mode:
    support: full
    details: Reads the job's state; a finished job's results file (Ansible's scratch file) is removed as in a run.
  diff_mode:
    support: none
seealso:
  - module: ansible.builtin.async_status
notes:
  - Runs on the host that runs the job, with the same C(become) (the results file is under that user's
    C(~/.ansible_async), and C(/proc) must show that user's processes).
"""

EXAMPLES = r"""
- name: Start the fetch
  model_weights:
    root: /mnt/model/glm
    link: /mnt/model/glm/GLM-5.2-NVFP4
    revision: "{{ rev }}"
    source: {type: hf, repo_id: nvidia/GLM-5.2-NVFP4}
  async: 14000
  poll: 0
  changed_when: false
  register: _fetch_job

- name: Wait for the fetch (fails within a poll or two if the job vanished)
  b300.pd.pd_async_job:
    jid: "{{ _fetch_job.ansible_job_id }}"
    results_file: "{{ _fetch_job.results_file }}"
    description: "model_weights fetch of {{ rev }}"
    host: "{{ inventory_hostname }}"
    limit_var: model_weights_async_timeout
  register: _fetch
  until: _fetch is finished
  retries: 1410
  delay: 10
"""

RETURN = r"""
state:
  description: C(running), C(finished) or C(vanished).
  returned: always
  type: str
  sample: running
finished:
  description: True once the job finished, failed, timed out or vanished (the loop's end).
  returned: always
  type: bool
started:
  description: Whether the job started.
  returned: always
  type: bool
ansible_job_id:
  description: The job id.
  returned: always
  type: str
  sample: j360874038559.4169
results_file:
  description: The job's results file.
  returned: always
  type: str
pids:
  description: Processes of the job found in C(/proc) (running only).
  returned: when running
  type: list
  elements: int
"""

import json  # noqa: E402
import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402 (community.general layout)
from ansible_collections.b300.pd.plugins.module_utils.pd_async import (  # noqa: E402
    FINISHED,
    RUNNING,
    is_timeout,
    job_status,
    timeout_message,
    vanished_message,
)

PROC_ROOT = "/proc"


def drop_results_file(module, results_file):
    """A finished job's results file is Ansible's scratch file (poll: N removes it too); a vanished one's stays."""
    try:
        os.unlink(results_file)
    except FileNotFoundError:
        pass
    except OSError as e:
        module.warn(f"could not remove the results file {results_file}: {e.strerror}")


def emit_job_result(module, jid, results_file, data):
    """Hand back the job's own result as this task's, as async_status does."""
    drop_results_file(module, results_file)
    data = dict(data, ansible_job_id=jid, results_file=results_file, state=FINISHED, started=True, finished=True)
    # The job's module already shaped (and no_log-masked) this result: write it as is and exit, exactly as
    # ansible-core's async_status does, instead of passing it through exit_json a second time.
    print(f"\n{json.dumps(data)}")  # pylint: disable=ansible-bad-function
    raise SystemExit(0)


def run_module():
    module = AnsibleModule(
        argument_spec=dict(
            jid=dict(type="str", required=True),
            results_file=dict(type="path", required=True),
            description=dict(type="str", default="async job"),
            host=dict(type="str"),
            limit_var=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    jid, results_file = p["jid"], p["results_file"]
    host = p["host"] or os.uname().nodename
    common = dict(ansible_job_id=jid, results_file=results_file, changed=False)
    if not jid.strip():
        module.fail_json(msg=f"{host}: jid is empty; pass ansible_job_id of the task started with poll: 0",
                         state="invalid", started=False, finished=True, **common)

    status = job_status(jid, results_file, PROC_ROOT)
    if status["state"] == RUNNING:
        module.exit_json(state=RUNNING, started=True, finished=False, pids=status["pids"],
                         msg=f"{host}: async job {jid} ({p['description']}) still running (pids "
                             f"{', '.join(map(str, status['pids']))})", **common)
    if status["state"] == FINISHED:
        if is_timeout(status["data"]):
            drop_results_file(module, results_file)
            module.fail_json(msg=timeout_message(host, jid, p["description"], p["limit_var"], status["data"]),
                             state=FINISHED, started=True, finished=True, **common)
        emit_job_result(module, jid, results_file, status["data"])
    module.fail_json(msg=vanished_message(host, jid, p["description"], results_file, status),
                     state=status["state"], started=True, finished=True, **common)


def main():
    run_module()


if __name__ == "__main__":
    main()
