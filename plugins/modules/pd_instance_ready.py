#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_instance_ready
short_description: Wait for a restarted vLLM instance's /health, failing at once when its unit fails
description:
  - Polls the instance's C(/health) on the host until it answers 200, and its systemd unit on each poll.
  - Fails as soon as the unit is C(failed), or has been restarted by systemd since this wait began
    (C(NRestarts) grew, that is the engine crashed during start-up and C(Restart=) brought it back), instead
    of waiting out the whole timeout. The failure names the unit, its state and the last lines of its journal.
  - Fails after O(timeout_s) seconds otherwise.
  - Reads only; changes nothing.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  unit:
    description: The instance's systemd unit (C(vllm-<name>.service)).
    type: str
    required: true
  url:
    description: The instance's health URL on the host (C(http://127.0.0.1:<port>/health)).
    type: str
    required: true
  timeout_s:
    description: Seconds to wait for a 200 in all.
    type: int
    default: 900
  poll_s:
    description: Seconds between polls.
    type: float
    default: 2
  journal_lines:
    description: Journal lines of the unit quoted in a failure.
    type: int
    default: 20
extends_documentation_fragment:
  - b300.pd.attributes
  - b300.pd.attributes.info_module
"""

EXAMPLES = r"""
- name: Wait until decode-0 is ready after its restart
  b300.pd.pd_instance_ready:
    unit: vllm-decode-0.service
    url: http://127.0.0.1:8200/health
    timeout_s: 900
"""

RETURN = r"""
ready_s:
  description: Seconds until /health answered 200.
  returned: success
  type: float
  sample: 26.9
polls:
  description: How many times /health was asked.
  returned: always
  type: int
  sample: 14
unit_state:
  description: C(ActiveState/SubState) of the unit at the last poll.
  returned: always
  type: str
  sample: active/running
"""

import time  # noqa: E402 (community.general layout: imports after DOCUMENTATION)
import urllib.error  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.urls import ConnectionError as UrlConnectionError  # noqa: E402
from ansible.module_utils.urls import open_url  # noqa: E402


def unit_status(module, unit):
    """(ActiveState, SubState, NRestarts) of a unit from `systemctl show`."""
    rc, out, err = module.run_command(
        ["systemctl", "show", "-p", "ActiveState", "-p", "SubState", "-p", "NRestarts", unit])
    if rc != 0:
        module.fail_json(msg=f"pd_instance_ready: systemctl show {unit} failed (rc {rc}): {err.strip()}")
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    try:
        restarts = int(props.get("NRestarts") or 0)
    except ValueError:
        restarts = 0
    return props.get("ActiveState", "?"), props.get("SubState", "?"), restarts


def healthy(url):
    try:
        # The instance's own local URL: never through a proxy from the environment.
        with open_url(url, timeout=5, use_proxy=False) as resp:
            return resp.status == 200
    except (urllib.error.URLError, UrlConnectionError, OSError, ValueError):
        return False


def journal(module, unit, lines):
    rc, out, _err = module.run_command(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"])
    return out.strip() if rc == 0 else ""


def wait_ready(module, params, *, clock=time.monotonic, sleep=time.sleep):
    """Poll until healthy; fail at once on a failed or systemd-restarted unit. Returns the result dict."""
    unit, url, timeout_s, poll_s = params["unit"], params["url"], params["timeout_s"], params["poll_s"]
    lines = params["journal_lines"]
    start = clock()
    _active, _sub, restarts0 = unit_status(module, unit)
    polls = 0
    state = "?/?"
    while True:
        active, sub, restarts = unit_status(module, unit)
        state = f"{active}/{sub}"
        polls += 1
        if active == "failed" or restarts > restarts0:
            why = "failed" if active == "failed" else f"was restarted by systemd {restarts - restarts0} time(s)"
            module.fail_json(
                msg=(f"pd_instance_ready: {unit} {why} while starting ({state}, {clock() - start:.0f} s after the "
                     f"restart); its journal:\n{journal(module, unit, lines)}"),
                polls=polls, unit_state=state)
        if healthy(url):
            return {"changed": False, "ready_s": round(clock() - start, 1), "polls": polls, "unit_state": state}
        if clock() - start >= timeout_s:
            module.fail_json(
                msg=(f"pd_instance_ready: {url} did not answer 200 within {timeout_s} s after the restart "
                     f"({unit}: {state}); see journalctl -u {unit}"),
                polls=polls, unit_state=state)
        sleep(poll_s)


def main():
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "url": {"type": "str", "required": True},
            "timeout_s": {"type": "int", "default": 900},
            "poll_s": {"type": "float", "default": 2},
            "journal_lines": {"type": "int", "default": 20},
        },
        supports_check_mode=True,
    )
    p = module.params
    if p["timeout_s"] < 1 or p["poll_s"] <= 0:
        module.fail_json(msg="pd_instance_ready: timeout_s must be >= 1 and poll_s > 0")
    module.exit_json(**wait_ready(module, p))


if __name__ == "__main__":
    main()
