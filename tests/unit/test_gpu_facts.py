"""gpu_facts: parsers and checks against the real H200 capture (tests/fixtures/gpu/h200, from the device run)
and the constructed B300 sample (tests/fixtures/gpu/b300-constructed, see its README), plus the module itself
with run_command faked."""
import importlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ansible_collections.b300.pd.plugins.module_utils import gpu_facts as gf  # noqa: E402  (plugins/module_utils/gpu_facts.py)

FIX = os.path.join(ROOT, "tests", "fixtures", "gpu")
H200 = os.path.join(FIX, "h200")
B300 = os.path.join(FIX, "b300-constructed")


def read(*parts):
    with open(os.path.join(*parts)) as f:
        return f.read()


H200_XML = read(H200, "nvidia-smi-q-x.xml")
H200_TOPO = read(H200, "nvidia-smi-topo-m.txt")
H200_NVLINK = read(H200, "nvidia-smi-nvlink-s.txt")
B300_XML = read(B300, "nvidia-smi-q-x.CONSTRUCTED.xml")
B300_TOPO = read(B300, "nvidia-smi-topo-m.CONSTRUCTED.txt")
B300_NVLINK = read(B300, "nvidia-smi-nvlink-s.CONSTRUCTED.txt")

# What inventory/b300 asks for, as the role passes it (roles/preflight/tasks/probe.yml).
B300_EXPECT = {"product": "NVIDIA B300", "count": 8, "driver_min": "580.0", "require_fabric": True,
               "require_nvlink": True, "require_persistence": True, "require_ecc": True, "rdma_devices": []}
# What tests/fixtures/gpu/inventories/h200-local asks for.
H200_EXPECT = dict(B300_EXPECT, product="NVIDIA H200", count=1, require_fabric=False, require_nvlink=False)


def facts(xml=H200_XML, nvlink=H200_NVLINK, rdma=None):
    return {"smi": gf.parse_smi_xml(xml), "nvlink": gf.parse_nvlink_status(nvlink), "rdma": rdma or {},
            "smi_error": None, "nvlink_error": None}


def kinds(problems):
    return sorted({p["kind"] for p in problems})


def mutate(xml, edits, gpu=0):
    """Set element texts (path -> value) in the gpu'th <gpu> of an nvidia-smi XML document."""
    header, body = xml.split("<nvidia_smi_log>", 1)
    root = ET.fromstring("<nvidia_smi_log>" + body)  # noqa: S314  (our own fixture)
    g = root.findall("gpu")[gpu]
    for path, value in edits.items():
        el = g.find(path)
        assert el is not None, path
        el.text = value
    return header + ET.tostring(root, encoding="unicode")


# ---------------------------------------------------------------- parsing the real H200 capture

def test_parse_h200_capture():
    smi = gf.parse_smi_xml(H200_XML)
    assert smi["driver_version"] == "580.159.04"
    assert smi["cuda_version"] == "13.0"
    assert smi["attached_gpus"] == 1
    [g] = smi["gpus"]
    assert g["product_name"] == "NVIDIA H200"
    assert g["product_architecture"] == "Hopper"
    assert g["pci_bus_id"] == "00000000:00:06.0"
    assert g["uuid"].startswith("GPU-")
    assert g["persistence_mode"] == "Enabled"
    assert g["mig_mode_current"] == "Disabled"
    assert g["ecc_mode_current"] == "Enabled"
    assert g["ecc_volatile_uncorrectable"] == 0
    assert g["ecc_aggregate_uncorrectable"] == 0
    assert g["retired_pages_sbe"] is None  # N/A on Hopper: row remapping replaced page retirement
    assert g["remapped_rows_uncorrectable"] == 0
    assert g["remapped_rows_pending"] is False and g["remapped_rows_failure"] is False
    assert (g["fabric_state"], g["fabric_status"]) == ("N/A", "N/A")


def test_parse_h200_topology_and_nvlink():
    topo = gf.parse_topo_matrix(H200_TOPO)  # the real file starts with an ANSI underline escape
    assert topo["devices"] == ["GPU0"]
    assert topo["matrix"]["GPU0"]["GPU0"] == "X"
    assert topo["cpu_affinity"] == {"GPU0": "0-15"}
    assert topo["numa_affinity"] == {"GPU0": "0"}
    assert topo["nic_names"] == {} and topo["gpu_nic"] == {"GPU0": {}}
    assert gf.parse_nvlink_status(H200_NVLINK) == {}  # one GPU, no NVLink: nvidia-smi prints nothing


def test_parse_b300_constructed():
    smi = gf.parse_smi_xml(B300_XML)
    assert len(smi["gpus"]) == 8
    assert {g["product_name"] for g in smi["gpus"]} == {"NVIDIA B300 SXM6 AC"}
    assert [g["index"] for g in smi["gpus"]] == list(range(8))
    assert {(g["fabric_state"], g["fabric_status"]) for g in smi["gpus"]} == {("Completed", "Success")}
    assert smi["gpus"][3]["fabric_clique_id"] == "32766"
    topo = gf.parse_topo_matrix(B300_TOPO)
    assert topo["devices"][:8] == [f"GPU{i}" for i in range(8)]
    assert topo["matrix"]["GPU0"]["GPU5"] == "NV18"
    assert topo["nic_names"]["NIC7"] == "mlx5_7"
    assert topo["gpu_nic"]["GPU2"]["mlx5_2"] == "PIX"
    assert topo["gpu_nic"]["GPU2"]["mlx5_1"] == "NODE"
    assert topo["gpu_nic"]["GPU2"]["mlx5_6"] == "SYS"
    assert topo["cpu_affinity"]["GPU6"] == "56-111,168-223"
    nvl = gf.parse_nvlink_status(B300_NVLINK)
    assert sorted(nvl) == list(range(8))
    assert {(v["active"], v["inactive"]) for v in nvl.values()} == {(18, 0)}


def test_old_ecc_schema_double_bit_total():
    xml = """<nvidia_smi_log><driver_version>535.1</driver_version><gpu id="0">
      <product_name>NVIDIA A100</product_name><ecc_errors><volatile>
      <single_bit><device_memory>4</device_memory><total>4</total></single_bit>
      <double_bit><device_memory>2</device_memory><total>2</total></double_bit>
      </volatile></ecc_errors></gpu></nvidia_smi_log>"""
    [g] = gf.parse_smi_xml(xml)["gpus"]
    assert g["ecc_volatile_uncorrectable"] == 2  # double-bit only; single-bit errors are corrected
    assert g["ecc_aggregate_uncorrectable"] is None


def test_nvlink_inactive_links_counted():
    text = "GPU 0: NVIDIA B300 SXM6 AC (UUID: GPU-x)\n\t Link 0: 53.125 GB/s\n\t Link 1: <inactive>\n"
    assert gf.parse_nvlink_status(text) == {0: {"name": "NVIDIA B300 SXM6 AC", "uuid": "GPU-x", "active": 1,
                                                "inactive": 1, "links": {0: "53.125 GB/s", 1: "<inactive>"}}}


@pytest.mark.parametrize("found,minimum,ok", [
    ("580.159.04", "580.0", True), ("580.0", "580", True), ("575.57.08", "580.0", False),
    ("590.1", "580.95.05", True), ("580.95.04", "580.95.05", False), ("", "580.0", False)])
def test_version_at_least(found, minimum, ok):
    assert gf.version_at_least(found, minimum) is ok


# ---------------------------------------------------------------- expectations

def test_h200_capture_passes_h200_expectations():
    assert gf.check_gpus(facts(), H200_EXPECT) == []


def test_h200_capture_fails_b300_expectations_naming_product_count_fabric():
    problems = gf.check_gpus(facts(), B300_EXPECT)
    assert kinds(problems) == ["count", "fabric", "nvlink", "product"]
    text = "\n".join(p["message"] for p in problems)
    assert "expected 8 GPUs, found 1 (NVIDIA H200)" in text
    assert "expected product 'NVIDIA B300', found 'NVIDIA H200'" in text
    assert "fabric state N/A / status N/A, need Completed / Success" in text


def test_b300_sample_passes_b300_expectations_with_rdma(tmp_path):
    for i in range(8):
        port = tmp_path / f"mlx5_{i}" / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "link_layer").write_text("InfiniBand\n")
    rdma = gf.read_rdma_devices(str(tmp_path))
    expect = dict(B300_EXPECT, rdma_devices=[f"mlx5_{i}:1" for i in range(8)])
    assert gf.check_gpus(facts(B300_XML, B300_NVLINK, rdma), expect) == []
    assert rdma["mlx5_3"]["ports"]["1"]["link_layer"] == "InfiniBand"


def test_b300_sample_fails_h200_expectations():
    problems = gf.check_gpus(facts(B300_XML, B300_NVLINK), H200_EXPECT)
    assert kinds(problems) == ["count", "product"]


PER_GPU_CASES = [
    ("persistence", {"persistence_mode": "Disabled"}, "persistence mode is Disabled"),
    ("mig", {"mig_mode/current_mig": "Enabled"}, "MIG mode is Enabled"),
    ("mig", {"mig_mode/pending_mig": "Enabled"}, "(pending Enabled)"),
    ("ecc_mode", {"ecc_mode/current_ecc": "Disabled"}, "ECC mode is Disabled"),
    ("ecc_errors", {"ecc_errors/volatile/dram_uncorrectable": "3"}, "3 volatile uncorrectable ECC errors"),
    ("ecc_errors", {"ecc_errors/volatile/sram_uncorrectable_secded": "1"}, "1 volatile uncorrectable"),
    ("ecc_errors", {"ecc_errors/aggregate/sram_threshold_exceeded": "Yes"}, "threshold exceeded"),
    ("retired_pages", {"retired_pages/pending_retirement": "Yes"}, "page retirement pending"),
    ("remapped_rows", {"remapped_rows/remapped_row_pending": "Yes"}, "row remapping pending"),
    ("remapped_rows", {"remapped_rows/remapped_row_failure": "Yes"}, "row remapping failed"),
    ("repair_pending", {"ecc_errors/channel_repair_pending": "Yes"}, "repair pending"),
    ("repair_pending", {"ecc_errors/tpc_repair_pending": "Yes"}, "repair pending"),
    ("unrepairable_memory", {"ecc_errors/unrepairable_memory": "Yes"}, "unrepairable memory"),
    ("fabric", {"fabric/state": "In Progress"}, "fabric state In Progress / status Success"),
    ("fabric", {"fabric/status": "Failure"}, "fabric state Completed / status Failure"),
]


@pytest.mark.parametrize("kind,edits,phrase", PER_GPU_CASES)
def test_each_problem_kind_on_one_b300_gpu(kind, edits, phrase):
    xml = mutate(B300_XML, edits, gpu=5)
    problems = gf.check_gpus(facts(xml, B300_NVLINK), B300_EXPECT)
    assert kinds(problems) == [kind], problems
    [p] = problems
    assert p["gpu"] == 5
    assert phrase in p["message"]
    assert "GPU 5 (00000000:BA:00.0)" in p["message"]


def test_aggregate_ecc_errors_are_facts_not_problems():
    # Lifetime counters stay after the rows were remapped; only volatile (since driver load) ones fail.
    xml = mutate(B300_XML, {"ecc_errors/aggregate/dram_uncorrectable": "7"})
    f = facts(xml, B300_NVLINK)
    assert f["smi"]["gpus"][0]["ecc_aggregate_uncorrectable"] == 7
    assert gf.check_gpus(f, B300_EXPECT) == []


def test_driver_too_old():
    problems = gf.check_gpus(facts(), dict(H200_EXPECT, driver_min="590.10"))
    assert [(p["kind"], p["message"]) for p in problems] == [
        ("driver", "driver 580.159.04 is older than the minimum 590.10")]


def test_nvlink_down_links_named():
    text = B300_NVLINK.replace("GPU 2: ", "GPU 2: ", 1)
    lines = text.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("GPU 2:")))
    lines[start + 4] = "\t Link 3: <inactive>"
    lines[start + 9] = "\t Link 8: <inactive>"
    problems = gf.check_gpus(facts(B300_XML, "\n".join(lines)), B300_EXPECT)
    assert [p["message"] for p in problems] == ["GPU 2 (00000000:60:00.0): 2 NVLink links inactive (3, 8)"]


def test_nvlink_status_unavailable_is_a_problem_only_when_required():
    f = dict(facts(B300_XML, B300_NVLINK), nvlink=None, nvlink_error="nvidia-smi nvlink -s failed (rc 3): x")
    assert [p["kind"] for p in gf.check_gpus(f, B300_EXPECT)] == ["nvlink"]
    assert gf.check_gpus(f, dict(B300_EXPECT, require_nvlink=False)) == []


def test_rdma_missing_and_down(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    rdma = gf.read_rdma_devices(str(tmp_path))
    f = dict(facts(B300_XML, B300_NVLINK, rdma), rdma_dir=str(tmp_path))
    problems = gf.check_gpus(f, dict(B300_EXPECT, rdma_devices=["mlx5_0:1", "mlx5_1:1"]))
    assert [p["message"] for p in problems] == [
        "RDMA device mlx5_0 port 1 is not ACTIVE (1: 1: DOWN)",
        f"RDMA device mlx5_1 not found in {tmp_path} (have: mlx5_0)"]
    none = gf.check_gpus(dict(facts(B300_XML, B300_NVLINK), rdma_dir="/x"), dict(B300_EXPECT, rdma_devices=["a:1"]))
    assert [p["message"] for p in none] == ["expected RDMA devices a:1, found none in /x (no RDMA driver / NIC)"]


def test_no_nvidia_smi():
    f = {"smi": None, "nvlink": None, "rdma": {}, "smi_error": "nvidia-smi not found"}
    problems = gf.check_gpus(f, B300_EXPECT)
    assert [(p["kind"], p["message"]) for p in problems] == [
        ("no_gpu", "expected 8 x NVIDIA B300, found no NVIDIA GPU (nvidia-smi not found)")]


def test_disk_free_nearest_parent_and_check(tmp_path):
    d = gf.disk_free(str(tmp_path / "not" / "yet"))
    assert d["checked_path"] == str(tmp_path)
    assert d["free_bytes"] > 0 and d["total_bytes"] >= d["free_bytes"]
    assert gf.check_disk(d, d["free_bytes"]) == []
    [p] = gf.check_disk(d, d["free_bytes"] + 1)
    assert p["kind"] == "disk" and str(tmp_path) in p["message"]


# ---------------------------------------------------------------- the module, run_command faked

def load_module():
    return importlib.import_module("ansible_collections.b300.pd.plugins.modules.gpu_facts")


def run_module(monkeypatch, capsys, args, outputs, *, smi_path="/usr/bin/nvidia-smi", timeout_path="/usr/bin/timeout"):
    """Run plugins/modules/gpu_facts.py main() with run_command / get_bin_path faked.

    Returns (result, nvidia-smi args)."""
    from ansible.module_utils import basic
    from ansible.module_utils.testing import patch_module_args

    calls = []
    prefix = [timeout_path, "-k", "10", str(args.get("command_timeout", 120))] if timeout_path else []

    def fake_run(self, cmd, *a, **kw):
        assert cmd[:len(prefix)] == prefix, cmd  # every nvidia-smi call is bounded by timeout(1)
        assert cmd[len(prefix)] == smi_path
        smi_args = cmd[len(prefix) + 1:]
        calls.append(smi_args)
        return outputs[" ".join(smi_args)]

    bins = {"nvidia-smi": smi_path, "timeout": timeout_path}
    monkeypatch.setattr(basic.AnsibleModule, "run_command", fake_run)
    monkeypatch.setattr(basic.AnsibleModule, "get_bin_path",
                        lambda self, name, required=False, opt_dirs=None: bins[name])
    mod = load_module()
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out), calls


def test_module_h200_against_b300_expectations(monkeypatch, capsys, tmp_path):
    outputs = {"-q -x": (0, H200_XML, ""), "nvlink -s": (0, H200_NVLINK, ""), "topo -m": (0, H200_TOPO, "")}
    args = {"expected_product": "NVIDIA B300", "expected_count": 8, "min_driver_version": "580.0",
            "require_fabric": True, "require_nvlink": True, "require_persistence": True, "require_ecc": True,
            "rdma_sysfs_dir": str(tmp_path / "ib"), "disk_path": str(tmp_path / "models"),
            "disk_min_free_bytes": 1, "_ansible_check_mode": True}
    res, calls = run_module(monkeypatch, capsys, args, outputs)
    assert calls == [["-q", "-x"], ["nvlink", "-s"], ["topo", "-m"]]
    assert res["changed"] is False and res["gpu_present"] is True and res["gpu_skip_reason"] == ""
    assert sorted({p["kind"] for p in res["problem_details"]}) == ["count", "fabric", "nvlink", "product"]
    assert res["problems"] == [p["message"] for p in res["problem_details"]]
    gf_ = res["gpu_facts"]
    assert (gf_["count"], gf_["driver_version"], gf_["product_names"]) == (1, "580.159.04", ["NVIDIA H200"])
    assert gf_["gpus"][0]["nvlink_active"] is None
    assert gf_["topology"]["cpu_affinity"] == {"GPU0": "0-15"}
    assert gf_["disk"]["checked_path"] == str(tmp_path)


def test_module_b300_sample_passes(monkeypatch, capsys, tmp_path):
    outputs = {"-q -x": (0, B300_XML, ""), "nvlink -s": (0, B300_NVLINK, ""), "topo -m": (0, B300_TOPO, "")}
    args = {"expected_product": "NVIDIA B300", "expected_count": 8, "min_driver_version": "580.0",
            "require_fabric": True, "require_nvlink": True, "require_persistence": True, "require_ecc": True,
            "rdma_sysfs_dir": str(tmp_path)}
    res, _calls = run_module(monkeypatch, capsys, args, outputs)
    assert res["problems"] == []
    assert res["gpu_facts"]["count"] == 8
    assert {g["nvlink_active"] for g in res["gpu_facts"]["gpus"]} == {18}
    assert res["gpu_facts"]["topology"]["gpu_nic"]["GPU7"]["mlx5_7"] == "PIX"


def test_module_without_nvidia_smi(monkeypatch, capsys, tmp_path):
    args = {"expected_product": "NVIDIA B300", "expected_count": 8, "rdma_sysfs_dir": str(tmp_path)}
    res, calls = run_module(monkeypatch, capsys, args, {}, smi_path=None)
    assert calls == []
    assert res["gpu_present"] is False
    assert res["gpu_skip_reason"] == "nvidia-smi not found"
    assert res["problems"] == ["expected 8 x NVIDIA B300, found no NVIDIA GPU (nvidia-smi not found)"]


def test_module_driver_not_loaded(monkeypatch, capsys, tmp_path):
    err = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
           "Make sure that the latest NVIDIA driver is installed and running.\n")
    res, calls = run_module(monkeypatch, capsys, {"expected_count": 8, "rdma_sysfs_dir": str(tmp_path)},
                            {"-q -x": (9, err, "")})
    assert calls == [["-q", "-x"]]
    assert res["gpu_present"] is False
    assert res["problems"] == ["expected 8 x NVIDIA GPU, found no NVIDIA GPU (nvidia-smi -q -x failed (rc 9): "
                               + err.strip() + ")"]


def test_module_nvidia_smi_hangs(monkeypatch, capsys, tmp_path):
    res, calls = run_module(monkeypatch, capsys, {"expected_count": 8, "command_timeout": 30,
                                                  "rdma_sysfs_dir": str(tmp_path)}, {"-q -x": (124, "", "")})
    assert calls == [["-q", "-x"]]
    assert res["gpu_present"] is False
    assert res["problems"] == ["expected 8 x NVIDIA GPU, found no NVIDIA GPU (nvidia-smi -q -x timed out after 30 s "
                               "(a GPU may have fallen off the bus: look for Xid 79 in dmesg))"]


def test_module_without_timeout_binary_still_probes(monkeypatch, capsys, tmp_path):
    outputs = {"-q -x": (0, H200_XML, ""), "nvlink -s": (2, "", "nvlink: not supported\n"),
               "topo -m": (0, H200_TOPO, "")}
    res, calls = run_module(monkeypatch, capsys, {"expected_product": "NVIDIA H200", "expected_count": 1,
                                                  "require_nvlink": True, "rdma_sysfs_dir": str(tmp_path)},
                            outputs, timeout_path=None)
    assert len(calls) == 3
    assert res["problems"] == ["NVLink status unavailable (nvidia-smi nvlink -s failed (rc 2): nvlink: not supported)"]
    assert res["gpu_facts"]["nvlink_error"].startswith("nvidia-smi nvlink -s failed (rc 2)")


def test_module_probe_gpu_false_skips_with_reason(monkeypatch, capsys, tmp_path):
    args = {"probe_gpu": False, "gpu_skip_reason": "pd_accelerator is 'cpu'", "expected_count": 8,
            "rdma_sysfs_dir": str(tmp_path), "disk_path": str(tmp_path), "disk_min_free_bytes": 2 ** 62}
    res, calls = run_module(monkeypatch, capsys, args, {})
    assert calls == []
    assert res["gpu_present"] is False and res["gpu_skip_reason"] == "pd_accelerator is 'cpu'"
    assert [p["kind"] for p in res["problem_details"]] == ["disk"]


def test_constructed_b300_files_match_their_generator():
    gen = os.path.join(B300, "make_b300_constructed.py")
    proc = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True, check=False)  # noqa: S603
    assert proc.returncode == 0, proc.stdout + proc.stderr


def inventory_instances(host):
    import yaml

    with open(os.path.join(ROOT, "inventory", "b300", "host_vars", host + ".yml")) as f:
        return yaml.safe_load(f)["pd_instances"]


@pytest.mark.parametrize("host", ["b300-01", "b300-02", "b300-03"])
def test_b300_inventory_instances_are_rail_aligned_on_the_b300_sample(host):
    topo = gf.parse_topo_matrix(B300_TOPO)
    instances = gf.instance_nics(inventory_instances(host))
    assert instances and all(i["nics"] for i in instances)
    assert gf.check_nic_affinity(topo, instances) == []


def test_nic_affinity_swapped_rails_named():
    topo = gf.parse_topo_matrix(B300_TOPO)
    inst = gf.instance_nics([{"name": "prefill-a", "gpus": [0, 1], "ucx_net_devices": "mlx5_4:1,mlx5_1:1"}])
    assert inst == [{"name": "prefill-a", "gpus": [0, 1], "nics": ["mlx5_4", "mlx5_1"]}]
    problems = gf.check_nic_affinity(topo, inst)
    assert [(p["kind"], p["gpu"], p["message"]) for p in problems] == [
        ("nic_affinity", 0, "instance prefill-a: GPU 0 has none of its ucx_net_devices behind its PCIe switch "
                            "(mlx5_4: SYS, mlx5_1: NODE); near it: mlx5_0")]
    # PXB (several bridges, same switch tree) counts as near by default, NODE only when asked for
    assert gf.check_nic_affinity(topo, gf.instance_nics([{"name": "x", "gpus": [0], "ucx_net_devices": "mlx5_1:1"}]),
                                 links=("PIX", "PXB", "NODE")) == []


def test_nic_affinity_without_nics_or_topology():
    inst = [{"name": "p", "gpus": [0], "nics": ["mlx5_0"]}]
    assert gf.check_nic_affinity(gf.parse_topo_matrix(H200_TOPO), inst) == []  # no NIC at all: RDMA check reports
    [p] = gf.check_nic_affinity({"error": "nvidia-smi topo -m failed (rc 3): x"}, inst)
    assert p["message"] == "cannot check GPU/NIC affinity: nvidia-smi topo -m failed (rc 3): x"
    assert gf.check_nic_affinity(None, []) == []
    [p] = gf.check_nic_affinity(gf.parse_topo_matrix(B300_TOPO), [{"name": "p", "gpus": [9], "nics": ["mlx5_0"]}])
    assert p["message"] == "instance p: GPU 9 is not in nvidia-smi topo -m"


def test_module_checks_nic_affinity_of_instances(monkeypatch, capsys, tmp_path):
    outputs = {"-q -x": (0, B300_XML, ""), "nvlink -s": (0, B300_NVLINK, ""), "topo -m": (0, B300_TOPO, "")}
    instances = inventory_instances("b300-01")
    instances[1]["ucx_net_devices"] = "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"  # prefill-b on GPUs 4-7: wrong rails
    res, _calls = run_module(monkeypatch, capsys, {"instances": instances, "rdma_sysfs_dir": str(tmp_path)}, outputs)
    assert [(p["kind"], p["gpu"]) for p in res["problem_details"]] == [("nic_affinity", g) for g in (4, 5, 6, 7)]
    assert res["problems"][0].startswith("instance prefill-b: GPU 4 has none of its ucx_net_devices")
