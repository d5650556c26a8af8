"""Verify of molecule/nvidia_driver: repository, exact versions, pins, holds, modules-load.d, services.

Expected versions come from the scenario's inventory (molecule.yml group_vars), i.e. what converge asked for.
Every check reads the host's real apt/dpkg/systemd state: removing a hold (`apt-mark unhold`), changing a
pinned version or the pin file, or stopping a service makes a test fail.
"""

from __future__ import annotations

import os
import re

import pytest
import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
HOSTS = sorted(RUNNER.get_hosts("all"))
testinfra_hosts = [f"ansible://{h}" for h in HOSTS]
VARS = RUNNER.get_variables(HOSTS[0])
BRANCH = VARS["nvidia_driver_branch"]
VERSION = VARS["nvidia_driver_version"]
NVLSM = VARS["nvidia_driver_nvlsm_version"]
WANTED = {
    f"nvidia-driver-{BRANCH}-open": VERSION,
    f"nvidia-fabricmanager-{BRANCH}": VERSION,
    f"libnvidia-nscq-{BRANCH}": VERSION,
    "nvidia-persistenced": VERSION,
    "nvlsm": NVLSM,
}
OLD_BRANCH_PACKAGES = ["nvidia-driver-570-open", "nvidia-fabricmanager-570", "libnvidia-nscq-570"]


def _installed_version(host, pkg):
    out = host.run(f"dpkg-query -W -f='${{Status}}|${{Version}}' {pkg}")
    if out.rc != 0 or " ok installed|" not in out.stdout:  # "install ok installed" or "hold ok installed"
        return None
    return out.stdout.split("|", 1)[1]


def test_deb822_source_with_signed_by(host):
    src = host.file("/etc/apt/sources.list.d/nvidia-cuda.sources")
    assert src.exists and src.mode == 0o644
    lines = [ln for ln in src.content_string.splitlines() if ": " in ln and not ln.startswith("#")]
    fields = dict(ln.split(": ", 1) for ln in lines)
    assert fields["Types"] == "deb"
    assert fields["URIs"] == VARS["nvidia_driver_repo_url"]
    assert fields["Suites"] == "/"
    assert fields["Signed-By"] == "/etc/apt/keyrings/nvidia-cuda.asc"
    key = host.file("/etc/apt/keyrings/nvidia-cuda.asc")
    assert key.exists and "BEGIN PGP PUBLIC KEY BLOCK" in key.content_string


def test_repository_is_trusted_by_signature(host):
    """apt accepted the repository's InRelease signature with the Signed-By key (not [trusted=yes])."""
    out = host.run("apt-get update 2>&1")
    assert out.rc == 0, out.stdout
    assert "NO_PUBKEY" not in out.stdout and "not signed" not in out.stdout, out.stdout
    policy = host.check_output("apt-cache policy")
    assert "127.0.0.1:8400" in policy, policy


@pytest.mark.parametrize("pkg", sorted(WANTED))
def test_exact_version_installed(host, pkg):
    version = _installed_version(host, pkg)
    assert version is not None, f"{pkg} not installed"
    assert re.match(rf"^{re.escape(WANTED[pkg])}-", version), f"{pkg} is {version}, wanted {WANTED[pkg]}-*"


@pytest.mark.parametrize("pkg", sorted(WANTED))
def test_held(host, pkg):
    held = host.check_output("apt-mark showhold").split()
    assert pkg in held, f"{pkg} is not held (held: {held})"


@pytest.mark.parametrize("pkg", sorted(WANTED))
def test_pinned_candidate(host, pkg):
    """The pin makes the wanted version apt's candidate although a newer one is in the repository."""
    policy = host.check_output(f"apt-cache policy {pkg}")
    candidate = re.search(r"Candidate: (\S+)", policy).group(1)
    assert candidate.startswith(f"{WANTED[pkg]}-"), policy
    versions = host.check_output(f"apt-cache madison {pkg}")
    newer = [line.split("|")[1].strip() for line in versions.splitlines()]
    assert any(not v.startswith(f"{WANTED[pkg]}-") for v in newer), f"repository has only one version of {pkg}"


def test_pin_file(host):
    pref = host.file("/etc/apt/preferences.d/nvidia-driver.pref")
    assert pref.exists and pref.mode == 0o644
    stanzas = [dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
               for block in pref.content_string.split("\n\n")]
    pins = {s["Package"]: s for s in stanzas if "Package" in s}
    assert set(pins) == set(WANTED)
    for pkg, version in WANTED.items():
        assert pins[pkg]["Pin"] == f"version {version}-*"
        assert pins[pkg]["Pin-Priority"] == "1001"


def test_upgrade_changes_nothing_nvidia(host):
    """A full upgrade would not touch the driver stack (pin + hold), although newer versions exist."""
    out = host.check_output("apt-get -s -o Debug::NoLocking=1 dist-upgrade")
    touched = [line for line in out.splitlines() if line.startswith(("Inst ", "Remv ")) and
               any(f" {p} " in f"{line} " for p in WANTED)]
    assert not touched, "\n".join(touched)


def test_old_branch_removed_and_nothing_broken(host):
    for pkg in OLD_BRANCH_PACKAGES:
        assert _installed_version(host, pkg) is None, f"{pkg} (old branch) still installed"
    assert host.run("apt-get check").rc == 0
    audit = host.run("dpkg --audit")
    assert audit.rc == 0 and audit.stdout.strip() == "", audit.stdout


def test_fabricmanager_matches_driver(host):
    drv = _installed_version(host, f"nvidia-driver-{BRANCH}-open")
    fm = _installed_version(host, f"nvidia-fabricmanager-{BRANCH}")
    assert drv == fm, f"driver {drv} != fabric manager {fm}"


def test_modules_load_config(host):
    conf = host.file("/etc/modules-load.d/nvidia-driver.conf")
    assert conf.exists and conf.mode == 0o644
    modules = [ln.strip() for ln in conf.content_string.splitlines() if ln.strip() and not ln.startswith("#")]
    assert modules == ["nvidia_peermem", "mlx5_ib", "ib_umad"]


def test_persistenced_runs_in_persistence_mode(host):
    svc = host.service("nvidia-persistenced")
    assert svc.is_running and svc.is_enabled
    exec_start = host.check_output("systemctl show -p ExecStart --value nvidia-persistenced")
    assert "--persistence-mode" in exec_start and "--no-persistence-mode" not in exec_start, exec_start


def test_fabricmanager_running(host):
    svc = host.service("nvidia-fabricmanager")
    assert svc.is_running and svc.is_enabled
