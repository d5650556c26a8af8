"""Every ANSIBLE_* environment variable the bundle's tests, benches and scripts set is one Ansible reads.

Ansible ignores an environment variable it does not know, silently: seven places set ANSIBLE_FACT_CACHING=memory
(the setting is ANSIBLE_CACHE_PLUGIN) to keep their plays' facts out of the clone's .cache/facts, and wrote them
there anyway. A local play that ran with pyenv's shims on its PATH cached /root/.pyenv/shims/python3.13 as
localhost's interpreter for an hour (fact_caching_timeout), and every later local play of the unit tests, with
another PATH, failed with "pyenv: python3.13: command not found" (2026-12-07). So each name is checked against
Ansible's own configuration definitions: the base settings and the options of its shell, callback, cache,
connection and become plugins.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Read by Ansible's configuration manager itself (which file to load), not a setting of its own.
NOT_SETTINGS = {"ANSIBLE_CONFIG"}
_NAME = re.compile(r"\bANSIBLE_[A-Z][A-Z0-9_]*\b")


def _ansible_env_names() -> set[str]:
    from ansible import constants as C  # noqa: N812 - Ansible's own name
    from ansible.plugins import loader

    names = {e["name"] for d in C.config.get_configuration_definitions().values() for e in (d.get("env") or [])}
    for kind, plugins in (("shell", loader.shell_loader), ("callback", loader.callback_loader),
                          ("cache", loader.cache_loader), ("connection", loader.connection_loader),
                          ("become", loader.become_loader)):
        for plugin in plugins.all(class_only=True):
            defs = C.config.get_configuration_definitions(kind, plugin._load_name) or {}
            names |= {e["name"] for d in defs.values() for e in (d.get("env") or [])}
    return names | NOT_SETTINGS


def _used_names() -> dict[str, list[str]]:
    files = subprocess.run(["git", "ls-files", "tests", "bench", "scripts", "molecule", ".ci"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    used: dict[str, list[str]] = {}
    for rel in files:
        if rel == "tests/unit/test_ansible_env_names.py":
            continue  # names the wrong one on purpose
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        for name in set(_NAME.findall(text)):
            used.setdefault(name, []).append(rel)
    return used


def test_every_ansible_env_var_set_is_one_ansible_reads():
    known = _ansible_env_names()
    assert "ANSIBLE_CACHE_PLUGIN" in known and "ANSIBLE_FACT_CACHING" not in known  # the names of the finding
    used = _used_names()
    assert "ANSIBLE_CACHE_PLUGIN" in used, "the unit tests keep their plays' facts in memory by this name"
    unknown = {name: files for name, files in used.items() if name not in known}
    assert not unknown, f"ANSIBLE_* names Ansible does not read (it ignores them silently): {unknown}"
