"""Host identity (issue #18): Ansible verifies ssh host keys for real inventories; only the embedded default opts out.

Vault secrets (the Hugging Face token, the router key) go to whatever answers at an inventory address: with
host-key checking off for every inventory, that is anyone who can take the address.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
INSECURE = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "StrictHostKeyChecking no")


def test_ansible_cfg_leaves_host_key_checking_on():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "ansible.cfg")
    value = cfg.get("defaults", "host_key_checking", fallback="true")
    assert value.strip().lower() in ("true", "yes", "1"), f"ansible.cfg sets host_key_checking = {value}"
    ssh_args = cfg.get("ssh_connection", "ssh_args", fallback="")
    assert not any(opt in ssh_args for opt in INSECURE), ssh_args


def test_real_inventory_turns_no_host_key_check_off():
    for path in sorted((ROOT / "inventory" / "b300").rglob("*.yml")):
        text = path.read_text()
        assert not any(opt in text for opt in INSECURE), f"{path.relative_to(ROOT)} disables host-key checking"


def test_local_inventory_opts_out_explicitly_and_only_there():
    conn = yaml.safe_load((ROOT / "inventory" / "local" / "group_vars" / "all" / "connection.yml").read_text())
    assert "StrictHostKeyChecking=no" in conn["ansible_ssh_common_args"]
