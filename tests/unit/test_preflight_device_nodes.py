"""preflight on GPU hosts: the device nodes the sandboxed vLLM unit opens exist (issue #18).

The vLLM unit has DevicePolicy=closed with a DeviceAllow list (plugins/module_utils/pd_unit.py UNIT_DEVICE_ALLOW), no
capability and ProtectKernelModules: it cannot make a node that is missing at start. gpu_facts' check_device_nodes
looks for each node in a fake /dev tree (dev_dir) and a fake /sys/class/infiniband (rdma_sysfs_dir); the GPUs are
those of the constructed B300 sample and the real H200 capture. main had no such check: every test here fails there
(no check_device_nodes function, no module option).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ansible_collections.b300.pd.plugins.module_utils import gpu_facts as gf
from ansible_collections.b300.pd.plugins.module_utils import pd_unit
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_library, run_module

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"
B300_XML = (FIX / "b300-constructed" / "nvidia-smi-q-x.CONSTRUCTED.xml").read_text()
H200 = FIX / "h200"


def _facts(xml=B300_XML, rdma_dir=None):
    return {"smi": gf.parse_smi_xml(xml), "rdma": gf.read_rdma_devices(str(rdma_dir)) if rdma_dir else {},
            "rdma_dir": str(rdma_dir)}


def _dev_tree(root, gpus=8, names=("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"), uverbs=()):
    dev = root / "dev"
    dev.mkdir()
    for n in (*names, *(f"nvidia{i}" for i in range(gpus))):
        (dev / n).write_text("")
    if uverbs:
        (dev / "infiniband").mkdir()
        for u in uverbs:
            (dev / "infiniband" / u).write_text("")
    return dev


def _ib_sysfs(root, devices):
    """A /sys/class/infiniband with {name: [uverbsN, ...]} (None: no infiniband_verbs dir, ib_uverbs not loaded)."""
    sysfs = root / "infiniband"
    for name, verbs in devices.items():
        port = sysfs / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        if verbs is not None:
            vdir = sysfs / name / "device" / "infiniband_verbs"
            vdir.mkdir(parents=True)
            for v in verbs:
                (vdir / v).mkdir()
    return sysfs


def _messages(problems):
    assert all(p["kind"] == "device_node" for p in problems), problems
    return [p["message"] for p in problems]


def test_every_node_present_is_no_problem(tmp_path):
    sysfs = _ib_sysfs(tmp_path, {"mlx5_0": ["uverbs0"], "mlx5_1": ["uverbs1"]})
    dev = _dev_tree(tmp_path, uverbs=("uverbs0", "uverbs1"))
    assert gf.check_device_nodes(_facts(rdma_dir=sysfs), str(dev), ["mlx5_0:1", "mlx5_1"]) == []
    # the nodes checked are those of the unit's DeviceAllow groups (docs/security.md lists both)
    groups = {d.split()[0] for d in pd_unit.UNIT_DEVICE_ALLOW}
    for group in ("char-nvidiactl", "char-nvidia", "char-nvidia-uvm", "char-nvidia-caps",
                  "char-nvidia-caps-imex-channels", "char-infiniband_verbs"):
        assert group in groups, group


@pytest.mark.parametrize(("missing", "fix"), [
    ("nvidiactl", "nvidia-modprobe -c 0"),
    ("nvidia-uvm", "nvidia-modprobe -u -c=0"),
    ("nvidia5", "nvidia-modprobe -c 5"),
])
def test_one_named_problem_per_missing_gpu_node(tmp_path, missing, fix):
    dev = _dev_tree(tmp_path)
    (dev / missing).unlink()
    msgs = _messages(gf.check_device_nodes(_facts(), str(dev)))
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"device node {dev}/{missing} missing: ") and fix in msgs[0]


def test_gpu_nodes_follow_the_minor_number_not_the_index(tmp_path):
    xml = re.sub(r"<minor_number>0</minor_number>", "<minor_number>7</minor_number>",
                 (H200 / "nvidia-smi-q-x.xml").read_text())
    dev = _dev_tree(tmp_path, gpus=1)  # nvidia0 only
    problems = gf.check_device_nodes(_facts(xml), str(dev))
    assert _messages(problems) == [f"device node {dev}/nvidia7 missing: the driver's nodes are made by "
                                   "nvidia-persistenced (roles/nvidia_driver) or, as root, by `nvidia-modprobe -c 7` "
                                   "(with /dev/nvidiactl)"]
    assert problems[0]["gpu"] == 0


def test_mig_needs_the_capability_nodes(tmp_path):
    xml = B300_XML.replace("<current_mig>Disabled</current_mig>", "<current_mig>Enabled</current_mig>", 1)
    assert xml != B300_XML
    dev = _dev_tree(tmp_path)
    msgs = _messages(gf.check_device_nodes(_facts(xml), str(dev)))
    assert len(msgs) == 1 and msgs[0].startswith(f"device node {dev}/nvidia-caps/nvidia-cap* missing: MIG is enabled")
    (dev / "nvidia-caps").mkdir()
    (dev / "nvidia-caps" / "nvidia-cap1").write_text("")
    assert gf.check_device_nodes(_facts(xml), str(dev)) == []


def test_imex_channel_only_when_required(tmp_path):
    dev = _dev_tree(tmp_path)
    assert gf.check_device_nodes(_facts(), str(dev)) == []
    msgs = _messages(gf.check_device_nodes(_facts(), str(dev), require_imex=True))
    assert msgs == [f"device node {dev}/nvidia-caps-imex-channels/channel0 missing: make IMEX channel 0 as root "
                    "(`nvidia-modprobe -i 0:1`), or load nvidia with NVreg_CreateImexChannel0=1"]


def test_rdma_verbs_nodes_of_the_configured_devices(tmp_path):
    sysfs = _ib_sysfs(tmp_path, {"mlx5_0": ["uverbs0"], "mlx5_1": None, "mlx5_9": ["uverbs9"]})
    dev = _dev_tree(tmp_path)  # no /dev/infiniband at all
    msgs = _messages(gf.check_device_nodes(_facts(rdma_dir=sysfs), str(dev), ["mlx5_0:1", "mlx5_1:1", "mlx5_7"]))
    assert msgs == [
        f"device node {dev}/infiniband/uverbs0 missing: verbs device of mlx5_0; load the verbs module as root "
        "(`modprobe ib_uverbs`; rdma-core's rdma-load-modules does it at boot)",
        f"RDMA device mlx5_1 has no verbs device ({sysfs}/mlx5_1/device/infiniband_verbs is empty or missing): load "
        "the verbs module as root (`modprobe ib_uverbs`; rdma-core's rdma-load-modules does it at boot)",
    ]  # mlx5_7 is not in sysfs (check_rdma names it); mlx5_9 is not configured


def test_a_host_without_gpus_checks_only_rdma(tmp_path):
    dev = tmp_path / "empty"
    dev.mkdir()
    assert gf.check_device_nodes({"smi": None, "rdma": {}}, str(dev)) == []


@pytest.mark.parametrize("enabled", [True, False])
def test_module_reports_missing_nodes_only_when_asked(tmp_path, monkeypatch, enabled):
    mod = load_library("gpu_facts")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    outputs = {"-q -x": (0, (H200 / "nvidia-smi-q-x.xml").read_text(), ""),
               "nvlink -s": (0, (H200 / "nvidia-smi-nvlink-s.txt").read_text(), ""),
               "topo -m": (0, (H200 / "nvidia-smi-topo-m.txt").read_text(), "")}

    def fake_run(self, cmd, *a, **kw):
        return outputs[" ".join(cmd[cmd.index(str(smi)) + 1:])]

    dev = _dev_tree(tmp_path, gpus=1, names=("nvidiactl",))
    res, failed = run_module(mod.main, {"nvidia_smi": str(smi), "rdma_sysfs_dir": str(tmp_path / "no-ib"),
                                        "check_device_nodes": enabled, "dev_dir": str(dev)},
                             check_mode=True, run_command=fake_run, monkeypatch=monkeypatch)
    assert not failed and res["gpu_present"], res
    nodes = [d for d in res["problem_details"] if d["kind"] == "device_node"]
    if enabled:
        assert [d["message"].split(" missing:")[0] for d in nodes] == [f"device node {dev}/nvidia-uvm"]
    else:
        assert nodes == []
