"""Verify of molecule/cuda_toolkit: exact version pinned and held, PATH and ld.so config; cpu host untouched.

The expected version comes from the scenario's inventory (molecule.yml). Reads the hosts' real apt, dpkg,
ldconfig and login-shell state: unholding, changing the version or the pin, or dropping the profile.d/ld.so
files makes a test fail.
"""

from __future__ import annotations

import os
import re

import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
HOSTS = sorted(RUNNER.get_hosts("all"))
testinfra_hosts = [f"ansible://{h}" for h in HOSTS]
VARS = {h: RUNNER.get_variables(h) for h in HOSTS}


def _vars(host):
    return VARS[host.backend.get_hostname()]


def _nvidia(host):
    return _vars(host)["pd_accelerator"] == "nvidia"


def _pkg(host):
    return "cuda-toolkit-" + _vars(host)["cuda_toolkit_release"].replace(".", "-")


def _home(host):
    return "/usr/local/cuda-" + _vars(host)["cuda_toolkit_release"]


def test_both_kinds_of_host():
    assert sorted(v["pd_accelerator"] for v in VARS.values()) == ["cpu", "nvidia"]


def test_exact_version_installed_and_held(host):
    pkg, version = _pkg(host), _vars(host)["cuda_toolkit_version"]
    out = host.run(f"dpkg-query -W -f='${{Status}}|${{Version}}' {pkg}")
    if not _nvidia(host):
        assert out.rc != 0 or " ok installed|" not in out.stdout, f"{pkg} installed on a cpu host"
        return
    # "hold ok installed": the selection is part of the status.
    assert out.stdout.startswith("hold ok installed|"), out.stdout
    assert re.match(rf"^{re.escape(version)}-", out.stdout.split("|")[1]), out.stdout
    assert pkg in host.check_output("apt-mark showhold").split(), f"{pkg} not held"


def test_pin_beats_newer_version(host):
    if not _nvidia(host):
        assert not host.file("/etc/apt/preferences.d/cuda-toolkit.pref").exists
        return
    pkg, version = _pkg(host), _vars(host)["cuda_toolkit_version"]
    pref = host.file("/etc/apt/preferences.d/cuda-toolkit.pref").content_string
    assert f"Package: {pkg}\nPin: version {version}-*\nPin-Priority: 1001" in pref, pref
    policy = host.check_output(f"apt-cache policy {pkg}")
    assert re.search(r"Candidate: (\S+)", policy).group(1).startswith(f"{version}-"), policy
    madison = [ln.split("|")[1].strip() for ln in host.check_output(f"apt-cache madison {pkg}").splitlines()]
    assert any(v > f"{version}-" and not v.startswith(version) for v in madison), f"no newer version in repo: {madison}"
    sim = host.check_output("apt-get -s -o Debug::NoLocking=1 dist-upgrade")
    assert f"Inst {pkg} " not in sim, sim


def test_nvcc_on_login_path(host):
    if not _nvidia(host):
        assert not host.file("/etc/profile.d/cuda-toolkit.sh").exists
        assert host.run("bash -lc 'command -v nvcc'").rc != 0
        return
    assert host.file("/etc/profile.d/cuda-toolkit.sh").mode == 0o644
    assert host.check_output("bash -lc 'command -v nvcc'") == f"{_home(host)}/bin/nvcc"
    out = host.check_output("bash -lc 'nvcc --version'")
    assert f"V{_vars(host)['cuda_toolkit_version']}" in out, out
    # Sourcing twice does not add the directory twice.
    path = host.check_output("bash -lc '. /etc/profile.d/cuda-toolkit.sh; echo $PATH'")
    assert path.split(":").count(f"{_home(host)}/bin") == 1, path


def test_linker_finds_toolkit_libraries(host):
    if not _nvidia(host):
        assert not host.file("/etc/ld.so.conf.d/cuda-toolkit.conf").exists
        return
    conf = host.file("/etc/ld.so.conf.d/cuda-toolkit.conf")
    assert conf.mode == 0o644 and f"{_home(host)}/lib64" in conf.content_string.splitlines()
    cache = host.check_output("ldconfig -p")
    assert f"libcudart.so.13 (libc6,x86-64) => {_home(host)}/lib64/libcudart.so.13" in cache, cache


def test_repository_only_on_nvidia_host(host):
    src = host.file("/etc/apt/sources.list.d/nvidia-cuda.sources")
    assert src.exists == _nvidia(host)
    if _nvidia(host):
        assert "Signed-By: /etc/apt/keyrings/nvidia-cuda.asc" in src.content_string
