"""Verify of molecule/rdma_nixl: NIXL in vLLM's venv, the UCX transport report, RDMA user space, the negative
cases' messages, and that the GPU-only roles left the cpu host alone.

The transport report is the role's fact `rdma_nixl_transports`, saved by converge; the transport check is
also re-run here independently (a NIXL agent with the UCX backend in the venv).
"""

from __future__ import annotations

import json
import os
import shlex

import pytest
import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
HOSTS = sorted(RUNNER.get_hosts("all"))
testinfra_hosts = [f"ansible://{h}" for h in HOSTS]
VARS = RUNNER.get_variables(HOSTS[0])
PY = f"{VARS['pd_vllm_prefix']}/current/bin/python"
SM = {"posix", "sysv", "cma", "knem", "xpmem"}


def _json(host, path):
    f = host.file(path)
    assert f.exists, f"{path} missing: converge did not record it"
    return json.loads(f.content_string)


def test_nixl_pinned_version_in_vllm_venv(host):
    out = host.check_output(f"{PY} -c 'import importlib.metadata as m; print(m.version(\"nixl\"))'")
    assert out == VARS["rdma_nixl_version"]
    # Installed from the wheelhouse only (pd_pip_no_index): pip has no index configured in the venv.
    assert host.file(f"{VARS['pd_vllm_prefix']}/current").is_symlink


def test_transport_fact(host):
    report = _json(host, "/var/lib/molecule-rdma_nixl/transports.json")
    assert report["ok"] is True, report
    assert report["ucx_tls"] == VARS["pd_ucx_env"]["UCX_TLS"]
    assert report["ucx_backend"] == "initialised"
    assert report["nixl_version"] == VARS["rdma_nixl_version"]
    assert "UCX" in report["nixl_plugins"]
    transports = set(report["transports"])
    assert {"tcp", "self"} <= transports and transports & SM, transports
    assert report["missing"] == []
    # tcp over the host's veth (its address is on it), not only loopback.
    assert any(r.startswith("tcp/") and not r.endswith("/lo") for r in report["resources"]), report["resources"]
    # With UCX_MODULES=^efa no system RDMA library is mapped next to NIXL's own copies.
    assert report["loaded_twice"] == [], report["loaded_twice"]


def test_nixl_agent_creates_ucx_backend_now(host):
    """Independent of the role: a NIXL agent in the venv brings up its UCX backend."""
    code = ("from nixl._api import nixl_agent, nixl_agent_config; "
            "a = nixl_agent('verify', nixl_agent_config(backends=['UCX'])); "
            "print('UCX-OK' if 'UCX' in a.backends else 'UCX-MISSING')")
    # The UCX environment vLLM's instances get (pd_ucx_env). Run through sh so the exit status is reported in
    # stdout rather than by testinfra's ansible backend: a crash at exit (SIGSEGV, 139) must fail here.
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in VARS["pd_ucx_env"].items())
    out = host.run("sh -c %s", f"{env} {PY} -c \"{code}\" 2>&1; echo EXIT=$?")
    assert "UCX-OK" in out.stdout, out.stdout + out.stderr
    assert "EXIT=0" in out.stdout, out.stdout


def test_negative_ucx_tls_fails_clearly(host):
    msg = _json(host, "/var/lib/molecule-rdma_nixl/negative.json")["ucx_tls"]
    assert msg != "NOT FAILED", "rdma_nixl accepted UCX_TLS=rc,self on a host without RDMA"
    # Either UCX comes up without rc (the check names the missing transport) or NIXL's UCX backend refuses to
    # start at all (NIXL_ERR_BACKEND, seen with UCX_TLS=rc,self on a host without RDMA): both must name the
    # host and the UCX_TLS that was used.
    assert host.backend.get_hostname() in msg and "UCX_TLS='rc,self'" in msg, msg
    assert "UCX_TLS lists rc" in msg or "NIXL_ERR_BACKEND" in msg, msg


def test_negative_net_devices_fail_naming_instance(host):
    msg = _json(host, "/var/lib/molecule-rdma_nixl/negative.json")["net_devices"]
    assert msg != "NOT FAILED", "rdma_nixl accepted ucx_net_devices that are not on the host"
    assert "instance decode-bogus" in msg and "mlx5_9" in msg and "mlx5_10" in msg, msg


def test_negative_exit_crash_fails_naming_the_fix(host):
    """Without UCX_MODULES=^efa on a host with rdma-core, the check process crashes at exit: the role must fail
    and say why (the libraries loaded twice) and what to set."""
    msg = _json(host, "/var/lib/molecule-rdma_nixl/negative.json")["exit_crash"]
    assert msg != "NOT FAILED", "rdma_nixl accepted a NIXL/UCX process that crashed at exit"
    assert host.backend.get_hostname() in msg and "rc 139 (SIGSEGV)" in msg, msg
    assert "libnl-route-3" in msg and 'UCX_MODULES: "^efa"' in msg, msg


@pytest.mark.parametrize("pkg", ["rdma-core", "ibverbs-utils", "infiniband-diags", "libibverbs1"])
def test_rdma_userspace_installed(host, pkg):
    assert host.package(pkg).is_installed


def test_gpu_roles_skipped_on_cpu_host(host):
    assert VARS["pd_accelerator"] == "cpu"
    for path in ["/etc/apt/sources.list.d/nvidia-cuda.sources", "/etc/apt/preferences.d/nvidia-driver.pref",
                 "/etc/modules-load.d/nvidia-driver.conf", "/etc/profile.d/cuda-toolkit.sh"]:
        assert not host.file(path).exists, f"{path} written on a cpu host"
    assert "nvidia" not in host.check_output("dpkg-query -W -f='${Package}\\n'")
