"""What the unit tests share: repo paths, the collection's modules by name, inventory loading, running a module
in-process. Imported as ansible_collections.b300.pd.tests.unit.pd_testlib (so ansible-test units runs them too);
the fixtures are in conftest.py."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import RECIPE_KEYS

ROOT = Path(__file__).resolve().parents[2]
# The control node's pinned vLLM venv (scripts/bootstrap.d/45-vllm-venv): tests that run vLLM's own parser use it.
VLLM_VENV_PY = ROOT / ".cache" / "vllm-venv" / "bin" / "python"


def run_vllm_plugin_child(module: str, program: str, env: dict) -> dict:
    """Run `program` with the vLLM venv's Python, where it imports the bundle's vLLM plugin `module` by name (the
    bootstrap installs roles/vllm_install/files/<module>.py there, as the role does on the hosts): the last line it
    prints, as JSON. Skips where the venv is missing; fails where the venv's copy of the plugin is not the repo's."""
    if not VLLM_VENV_PY.exists():
        pytest.skip(f"{VLLM_VENV_PY} missing: run scripts/bootstrap --local (stage 45-vllm-venv)")
    source = ROOT / "roles" / "vllm_install" / "files" / f"{module}.py"
    installed = subprocess.run(  # noqa: S603
        [str(VLLM_VENV_PY), "-c", f"import {module}; print({module}.__file__)"], env=env, capture_output=True,
        text=True, timeout=120, check=False)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert Path(installed.stdout.strip()).read_bytes() == source.read_bytes(), (
        f"{VLLM_VENV_PY}'s {module}.py is not the repo's: run scripts/bootstrap --local (stage 45-vllm-venv)")
    proc = subprocess.run([str(VLLM_VENV_PY), "-c", program], env=env, capture_output=True, text=True,  # noqa: S603
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_library(name: str):
    """The module plugins/modules/<name>.py, imported as the package Ansible runs it from (b300.pd)."""
    return importlib.import_module(f"ansible_collections.b300.pd.plugins.modules.{name}")


def load_inventory(name: str) -> dict:
    """Read inventory/<name> (the real YAML files): group vars of all, host vars, vllm_hosts with addresses."""
    inv = ROOT / "inventory" / name
    group_vars: dict = {}
    for f in sorted((inv / "group_vars" / "all").glob("*.yml")):
        group_vars.update(yaml.safe_load(f.read_text()) or {})
    tree = yaml.safe_load((inv / "hosts.yml").read_text())
    top = tree[next(iter(tree))]
    vllm_hosts = top["children"]["vllm_hosts"]["hosts"]
    hosts = {}
    for host, hv in vllm_hosts.items():
        merged = dict(group_vars)
        hv_file = inv / "host_vars" / f"{host}.yml"
        if hv_file.exists():
            merged.update(yaml.safe_load(hv_file.read_text()) or {})
        merged.update(hv or {})
        hosts[host] = merged
    return {"group_vars": group_vars, "hosts": hosts, "recipe": {k: group_vars[k] for k in RECIPE_KEYS}}


def topology_input(inv: dict) -> dict:
    """The `hosts` argument of pd_topology, as playbooks/validate.yml builds it."""
    return {
        h: {
            "ansible_host": hv.get("ansible_host"),
            "pd_gpus_per_host": hv.get("pd_gpus_per_host"),
            "pd_instances": hv.get("pd_instances"),
        }
        for h, hv in inv["hosts"].items()
    }


class ModuleExit(Exception):
    def __init__(self, result: dict, failed: bool):
        super().__init__(json.dumps(result, default=str)[:2000])
        self.result = result
        self.failed = failed


def run_module(main, args: dict, *, check_mode: bool = False, diff: bool = False, run_command=None, monkeypatch=None):
    """Run a module's main() in-process; returns (result, failed). run_command replaces AnsibleModule.run_command."""

    def _exit(self, **kw):
        raise ModuleExit(kw, False)

    def _fail(self, msg, **kw):
        kw["msg"] = msg
        raise ModuleExit(kw, True)

    full = dict(args, _ansible_check_mode=check_mode, _ansible_diff=diff)
    assert monkeypatch is not None
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail)
    if run_command is not None:
        monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    with patch_module_args(full):
        try:
            main()
        except ModuleExit as e:
            return e.result, e.failed
    raise AssertionError("module returned without exit_json/fail_json")


def need_vllm_venv() -> None:
    """Fail (or, with PD_ALLOW_NO_VLLM=1, skip) a test that needs the control node's vLLM venv."""
    if VLLM_VENV_PY.exists():
        return
    if os.environ.get("PD_ALLOW_NO_VLLM") == "1":
        pytest.skip(f"{VLLM_VENV_PY} absent and PD_ALLOW_NO_VLLM=1")
    pytest.fail(f"{VLLM_VENV_PY} is missing: run scripts/bootstrap --local (or set PD_ALLOW_NO_VLLM=1 to skip)")
