"""Host identity (issue #18): Ansible verifies ssh host keys for real inventories; only the embedded default opts out.

Vault secrets (the Hugging Face token, the router key) go to whatever answers at an inventory address: with
host-key checking off for every inventory, that is anyone who can take the address.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest
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


def test_real_inventory_pins_its_own_known_hosts_strictly():
    conn = yaml.safe_load((ROOT / "inventory" / "b300" / "group_vars" / "all" / "connection.yml").read_text())
    assert conn["pd_ssh_known_hosts"] == "{{ inventory_dir }}/known_hosts"
    args = conn["ansible_ssh_common_args"].split()
    assert "UserKnownHostsFile={{" in " ".join(args) and "StrictHostKeyChecking=yes" in args
    assert "GlobalKnownHostsFile=/dev/null" in args
    assert (ROOT / "inventory" / "b300" / "known_hosts").is_file()


def _validate_known_hosts(inv: Path) -> subprocess.CompletedProcess:
    """Only validate.yml's host-key play (tag known_hosts): the control node alone, no host contacted."""
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run(  # noqa: S603 - the repo's own ansible-playbook
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inv), str(ROOT / "playbooks" / "validate.yml"),
         "--tags", "known_hosts",
         "-e", "vault_pd_router_api_key=" + "0" * 64],  # the vault's workers' key (validate refuses none)
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )


def _host_key_line(tmp_path: Path, name: str) -> str:
    key = tmp_path / f"hostkey-{len(list(tmp_path.glob('hostkey-*')))}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)  # noqa: S603, S607
    return name + " " + " ".join(key.with_suffix(".pub").read_text().split()[:2]) + "\n"


@pytest.fixture
def b300_copy(tmp_path):
    if not shutil.which("ssh-keygen"):
        pytest.skip("no ssh-keygen here")
    inv = tmp_path / "b300"
    shutil.copytree(ROOT / "inventory" / "b300", inv)
    return inv


def test_validate_refuses_hosts_without_a_pinned_key_naming_host_and_fix(b300_copy, tmp_path):
    kh = b300_copy / "known_hosts"
    kh.write_text(kh.read_text() + _host_key_line(tmp_path, "192.0.2.11"))
    proc = _validate_known_hosts(b300_copy)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "b300-02 (192.0.2.12)" in out and "b300-03 (192.0.2.13)" in out, out[-3000:]
    assert "b300-01 (192.0.2.11)" not in out.split("FAILED!", 1)[1], out[-3000:]
    assert "docs/security.md" in out and "ssh-keyscan" in out


def test_validate_passes_with_every_key_pinned_hashed_or_on_another_port(b300_copy, tmp_path):
    hosts = b300_copy / "hosts.yml"
    port = "ansible_host: 192.0.2.13\n          ansible_port: 2222"
    hosts.write_text(hosts.read_text().replace("ansible_host: 192.0.2.13", port))
    kh = b300_copy / "known_hosts"
    kh.write_text(kh.read_text() + _host_key_line(tmp_path, "192.0.2.11") + _host_key_line(tmp_path, "192.0.2.12")
                  + _host_key_line(tmp_path, "[192.0.2.13]:2222"))
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], check=True, capture_output=True)  # noqa: S603, S607
    proc = _validate_known_hosts(b300_copy)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for label in ("b300-01 (192.0.2.11)", "b300-02 (192.0.2.12)", "b300-03 ([192.0.2.13]:2222)"):
        assert f"(item={label})" in proc.stdout, proc.stdout[-3000:]


def test_validate_names_a_missing_known_hosts_file(b300_copy):
    (b300_copy / "known_hosts").unlink()
    proc = _validate_known_hosts(b300_copy)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "b300-01 (192.0.2.11)" in out and "known_hosts" in out, out[-3000:]


def test_local_inventory_has_no_pinned_keys_to_check():
    proc = _validate_known_hosts(ROOT / "inventory" / "local")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
