"""Every role entry point another role or playbook includes (tasks_from) is checked against its argument_spec.

Ansible validates a tasks_from entry point only when tasks_from names the spec's entry point exactly: with
`tasks_from: instance.yml` it looks up an entry point called "instance.yml", finds none and validates nothing,
silently. So the callers name entry points without the extension, and each named one has a spec.
"""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INCLUDE_KEYS = ("ansible.builtin.include_role", "ansible.builtin.import_role", "include_role", "import_role")


def _walk(node):
    if isinstance(node, dict):
        for key in INCLUDE_KEYS:
            args = node.get(key)
            if isinstance(args, dict) and "tasks_from" in args:
                yield args["name"], args["tasks_from"]
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def _callers():
    files = sorted(ROOT.glob("playbooks/*.yml")) + sorted(ROOT.glob("roles/*/tasks/*.yml")) + sorted(
        ROOT.glob("roles/*/handlers/*.yml")) + [ROOT / "site.yml"]
    for path in files:
        for role, entry in _walk(yaml.safe_load(path.read_text())):
            yield pytest.param(path.relative_to(ROOT), role, entry, id=f"{path.relative_to(ROOT)}:{role}:{entry}")


CALLERS = list(_callers())


def test_the_bundle_has_entry_point_callers():
    assert len(CALLERS) >= 9, CALLERS  # deploy.yml alone includes five pd_rollout entry points


@pytest.mark.parametrize(("caller", "role", "entry"), CALLERS)
def test_entry_point_is_validated_by_its_argument_spec(caller, role, entry):
    assert role.startswith("b300.pd."), f"{caller}: name role {role!r} by its FQCN (b300.pd.<role>)"
    role = role.removeprefix("b300.pd.")
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert not entry.endswith((".yml", ".yaml")), (
        f"{caller}: tasks_from {entry!r}: Ansible looks up the argument_spec entry point by this exact name, so "
        f"{role}'s spec would never run; write tasks_from: {entry.rsplit('.', 1)[0]}")
    assert entry in specs, f"{caller}: roles/{role}/meta/argument_specs.yml has no entry point {entry!r}; add one"
    assert (ROOT / "roles" / role / "tasks" / f"{entry}.yml").is_file()
