"""The real playbooks/preflight.yml, run with ansible-playbook against this machine (ansible_connection=local):

- inventory/local (pd_accelerator cpu): passes, GPU checks skipped with the reason stated;
- inventory/b300 on a machine without nvidia-smi: fails naming "no NVIDIA GPU (nvidia-smi not found)";
- a fake nvidia-smi on PATH replaying the real H200 capture (tests/fixtures/gpu/h200): the H200 inventory
  passes (in --check mode) and inventory/b300 fails naming count, product and fabric.
The four runs go in parallel (one fixture) to stay well under 30 s.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200_DIR = os.path.join(ROOT, "tests", "fixtures", "gpu", "h200")
H200_INV = os.path.join(ROOT, "tests", "fixtures", "gpu", "inventories", "h200-local")
PLAYBOOK = os.path.join(ROOT, "playbooks", "preflight.yml")
FAKE_SMI = """#!/bin/sh
# replays a real capture: tests/fixtures/gpu/h200
case "$*" in
  "-q -x") exec cat "$FAKE_SMI_DIR/nvidia-smi-q-x.xml" ;;
  "nvlink -s") exec cat "$FAKE_SMI_DIR/nvidia-smi-nvlink-s.txt" ;;
  "topo -m") exec cat "$FAKE_SMI_DIR/nvidia-smi-topo-m.txt" ;;
  *) echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2 ;;
esac
"""


def smi_on_host():
    dirs = os.environ.get("PATH", "").split(os.pathsep) + ["/sbin", "/usr/sbin", "/usr/local/sbin"]
    return any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in dirs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preflight")
    fake_bin = tmp / "fakebin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text(FAKE_SMI)
    (fake_bin / "nvidia-smi").chmod(0o755)
    playbook_bin = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    base_env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"), LC_ALL="C.UTF-8",
                    ANSIBLE_NOCOLOR="1", FAKE_SMI_DIR=H200_DIR)
    fake_env = dict(base_env, PATH=str(fake_bin) + os.pathsep + base_env.get("PATH", ""))
    local = ["-e", "ansible_connection=local", "-e", "ansible_python_interpreter=" + sys.executable]
    # the H200 host's device nodes (the sandboxed vLLM unit's, checked by preflight): all of them, and all but UVM
    devs = {}
    for name, nodes in (("dev", ("nvidiactl", "nvidia-uvm", "nvidia0")), ("dev-no-uvm", ("nvidiactl", "nvidia0"))):
        devs[name] = tmp / name
        devs[name].mkdir()
        for node in nodes:
            (devs[name] / node).write_text("")
    h200 = ["-i", H200_INV, "--check", "-e", "preflight_min_cpus=1", "-e", "preflight_min_memory_mb=1",
            "-e", "pd_model_size_bytes=1"]
    b300 = ["-i", os.path.join(ROOT, "inventory", "b300"), "--limit", "b300-01", "-e", "ansible_host=127.0.0.1"]
    specs = {
        "cpu": (["-i", os.path.join(ROOT, "inventory", "local"), "--limit", "pd-prefill-0"], base_env),
        "b300_no_gpu": (b300, base_env),
        # the test machine is not sized like the device: relax CPUs / disk, keep every GPU expectation
        "h200_fake": (h200 + ["-e", f"preflight_dev_dir={devs['dev']}"], fake_env),
        "h200_fake_no_uvm": (h200 + ["-e", f"preflight_dev_dir={devs['dev-no-uvm']}"], fake_env),
        "b300_fake_h200": (b300, fake_env),
    }
    procs = {}
    for name, (args, run_env) in specs.items():
        env = dict(run_env, ANSIBLE_CACHE_PLUGIN_CONNECTION=str(tmp / ("facts-" + name)),
                   ANSIBLE_LOCAL_TEMP=str(tmp / ("ansible-" + name)))
        procs[name] = subprocess.Popen([playbook_bin, PLAYBOOK] + args + local, cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for name, p in procs.items():
        text, _stderr = p.communicate(timeout=120)
        # the yaml callback wraps long lines: compare on whitespace-collapsed text
        out[name] = (p.returncode, " ".join(text.split()))
    return out


def test_cpu_inventory_passes_and_says_why_gpu_checks_skip(runs):
    rc, out = runs["cpu"]
    assert rc == 0, out
    assert "pd-prefill-0: GPU checks skipped: pd_accelerator is cpu, GPU checks apply to nvidia only" in out
    assert "pd-prefill-0: preflight passed (GPU checks skipped;" in out
    assert "failed=0" in out


@pytest.mark.skipif(smi_on_host(), reason="this machine has an nvidia-smi: the no-GPU case cannot be shown here")
def test_b300_inventory_without_gpu_fails_with_named_reason(runs):
    rc, out = runs["b300_no_gpu"]
    assert rc == 2, out
    assert "- b300-01: expected 8 x NVIDIA B300, found no NVIDIA GPU (nvidia-smi not found)" in out
    assert "b300-01: preflight found" in out
    # one failure, listing every problem: the GPU line and the host lines come in the same message
    assert out.count("fatal: [b300-01]") == 1


def test_h200_capture_passes_h200_inventory_in_check_mode(runs):
    rc, out = runs["h200_fake"]
    assert rc == 0, out
    assert "h200-01: 1 x NVIDIA H200, driver 580.159.04, CUDA 13.0, fabric N/A" in out
    assert "h200-01: preflight passed (1 x NVIDIA H200;" in out
    assert "changed=0" in out and "failed=0" in out


def test_h200_host_without_uvm_node_fails_naming_it_and_the_fix(runs):
    rc, out = runs["h200_fake_no_uvm"]
    assert rc == 2, out
    assert "h200-01: preflight found 1 problem(s):" in out
    assert "/dev-no-uvm/nvidia-uvm missing: load the UVM module and make its nodes as root: `nvidia-modprobe -u -c=0`" \
        in out


def test_h200_capture_fails_b300_inventory_naming_product_count_fabric(runs):
    rc, out = runs["b300_fake_h200"]
    assert rc == 2, out
    assert "- b300-01: expected 8 GPUs, found 1 (NVIDIA H200)" in out
    assert "- b300-01: expected product 'NVIDIA B300', found 'NVIDIA H200' on 1 of 1 GPUs (0)" in out
    assert "- b300-01: GPU 0 (00000000:00:06.0): NVLink fabric state N/A / status N/A, need Completed / Success" in out
    assert "- b300-01: GPU 0 (00000000:00:06.0): no active NVLink link" in out
    assert "found no NVIDIA GPU" not in out


def test_gpu_check_capture_writes_what_nvidia_smi_prints(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text(FAKE_SMI)
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=str(fake_bin) + os.pathsep + os.environ.get("PATH", ""), FAKE_SMI_DIR=H200_DIR,
               PYTHON=sys.executable)
    out = tmp_path / "cap"
    p = subprocess.run([os.path.join(ROOT, "scripts", "gpu-check"), "capture", str(out)], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    for name in ("nvidia-smi-q-x.xml", "nvidia-smi-topo-m.txt", "nvidia-smi-nvlink-s.txt"):
        with open(os.path.join(H200_DIR, name)) as want:
            assert (out / name).read_text() == want.read(), name
    host = (out / "host.txt").read_text()
    assert "nvidia-smi: " + str(fake_bin / "nvidia-smi") in host and "\nrc 0\n" in host
    # the fake knows no --version: the capture records its complaint instead of stopping
    assert "unexpected arguments: --version" in (out / "nvidia-smi-version.txt").read_text()
    assert "## ls /sys/class/infiniband" in (out / "rdma-nixl-ucx.txt").read_text()


def test_gpu_check_capture_without_nvidia_smi(tmp_path):
    if smi_on_host():
        pytest.skip("this machine has an nvidia-smi")
    out = tmp_path / "cap"
    p = subprocess.run([os.path.join(ROOT, "scripts", "gpu-check"), "capture", str(out)],
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr
    assert "nvidia-smi: absent" in (out / "host.txt").read_text()
    assert not (out / "nvidia-smi-q-x.xml").exists()
