#!/usr/bin/python
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)


DOCUMENTATION = r"""
---
module: gpu_facts
short_description: Read NVIDIA GPU, NVLink, topology, RDMA and disk facts and compare them with expectations
description:
  - Runs C(nvidia-smi -q -x), C(nvidia-smi nvlink -s) and C(nvidia-smi topo -m), reads
    C(/sys/class/infiniband) and the free space of a path, and returns the parsed facts as C(gpu_facts).
  - Compares the facts with the expectations given as options and returns every mismatch in C(problems)
    (one sentence each) and C(problem_details) (kind, gpu, message). The module never fails because of a
    problem; the caller (role C(preflight)) decides.
  - When C(nvidia-smi) is absent or cannot talk to the driver it returns C(gpu_present=false) and a
    C(no_gpu) problem naming the reason, instead of failing.
  - Only reads; supports check mode.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
extends_documentation_fragment:
  - b300.pd.attributes
  - b300.pd.attributes.info_module
options:
  probe_gpu:
    description:
      - Probe the NVIDIA GPUs. With V(false) only the disk and RDMA checks run and C(gpu_skip_reason) says why.
    type: bool
    default: true
  gpu_skip_reason:
    description: Reason reported in C(gpu_skip_reason) when O(probe_gpu=false).
    type: str
    default: GPU checks not requested
  nvidia_smi:
    description: Name (looked up in E(PATH) and the sbin directories) or absolute path of C(nvidia-smi).
    type: str
    default: nvidia-smi
  command_timeout:
    description:
      - Seconds each C(nvidia-smi) call may take (through C(timeout), when the host has it) before it counts as
        failed; a GPU that fell off the bus can hang C(nvidia-smi).
    type: int
    default: 120
  expected_product:
    description: Substring every GPU's product name must contain (case-insensitive), e.g. C(NVIDIA B300).
    type: str
    default: ""
  expected_count:
    description: Exact number of GPUs the host must show. V(0) skips the check.
    type: int
    default: 0
  min_driver_version:
    description: Lowest acceptable driver version, compared numerically part by part (C(580.0)).
    type: str
    default: ""
  require_fabric:
    description:
      - Every GPU's NVLink fabric must report state C(Completed) and status C(Success) (B300/HGX NVLink
        systems; PCIe cards and single GPUs show C(N/A)).
    type: bool
    default: false
  require_nvlink:
    description: Every GPU must have at least one active NVLink link and none inactive (C(nvidia-smi nvlink -s)).
    type: bool
    default: false
  require_persistence:
    description: Persistence mode must be C(Enabled) on every GPU.
    type: bool
    default: false
  require_ecc:
    description: ECC mode must be C(Enabled) on every GPU.
    type: bool
    default: false
  rdma_devices:
    description:
      - RDMA devices that must exist with an C(ACTIVE) port, as C(mlx5_0) or C(mlx5_0:1) (the UCX_NET_DEVICES form).
    type: list
    elements: str
    default: []
  instances:
    description:
      - The host's C(pd_instances) entries, as they are in the inventory. Every GPU of an instance with
        C(ucx_net_devices) must reach one of those NICs through its own PCIe switch (C(nvidia-smi topo -m)
        relation in O(nic_affinity_links)). GPU indices are nvidia-smi's (PCI bus order). Only C(name), C(gpus)
        and C(ucx_net_devices) are read.
    type: list
    elements: dict
    default: []
  nic_affinity_links:
    description: C(topo -m) relations that count as near (C(PIX), C(PXB)).
    type: list
    elements: str
    default: [PIX, PXB]
  rdma_sysfs_dir:
    description: Directory listing the RDMA devices.
    type: path
    default: /sys/class/infiniband
  check_device_nodes:
    description:
      - Check that the device nodes the sandboxed vLLM unit opens exist under O(dev_dir) (its C(DeviceAllow) list,
        docs/security.md) - C(nvidiactl), C(nvidia-uvm), C(nvidia<minor>) of every GPU listed,
        C(nvidia-caps/nvidia-cap*) when a GPU runs MIG, C(nvidia-caps-imex-channels/channel0) with
        O(require_imex_channels), and C(infiniband/uverbs<N>) of every O(rdma_devices) entry. One C(device_node)
        problem per missing node, naming the command that makes it. GPU nodes only when a GPU was found.
    type: bool
    default: false
  dev_dir:
    description: Directory holding the device nodes (tests point it at a fake tree).
    type: path
    default: /dev
  require_imex_channels:
    description:
      - With O(check_device_nodes), IMEX channel 0 must exist (CUDA fabric memory handles across NVLink domains).
    type: bool
    default: false
  disk_path:
    description:
      - Path whose filesystem must have O(disk_min_free_bytes) free. When it does not exist yet, its nearest
        existing parent is measured. Empty skips the disk check.
    type: path
  disk_min_free_bytes:
    description: Minimum free bytes on O(disk_path). V(0) only reports the free space.
    type: int
    default: 0
notes:
  - Supports C(check_mode); the module changes nothing.
  - Problems of other kinds (MIG enabled, uncorrectable ECC errors since driver load, SRAM ECC threshold
    exceeded, pending page retirement, pending or failed row remapping, pending channel/TPC repair,
    unrepairable memory) are always reported.
"""

EXAMPLES = r"""
- name: Probe the GPUs of a B300 host
  b300.pd.gpu_facts:
    expected_product: NVIDIA B300
    expected_count: 8
    min_driver_version: "580.0"
    require_fabric: true
    require_nvlink: true
    require_persistence: true
    rdma_devices: [mlx5_0, mlx5_1]
    disk_path: /mnt/model/glm
    disk_min_free_bytes: 600000000000
  register: gpu

- name: Stop on any problem
  ansible.builtin.fail:
    msg: "{{ gpu.problems | join('; ') }}"
  when: gpu.problems | length > 0
"""

RETURN = r"""
gpu_present:
  description: Whether nvidia-smi ran and listed at least one GPU (false when O(probe_gpu=false)).
  returned: always
  type: bool
gpu_skip_reason:
  description: Why the GPUs were not probed, or why none was found; empty when they were.
  returned: always
  type: str
problems:
  description: One sentence per mismatch with the expectations; empty when all hold.
  returned: always
  type: list
  elements: str
  sample: ["expected 8 GPUs, found 1 (NVIDIA H200)"]
problem_details:
  description: The same problems as dicts with C(kind) (no_gpu, count, product, driver, persistence, mig,
    ecc_mode, ecc_errors, retired_pages, remapped_rows, repair_pending, unrepairable_memory, fabric, nvlink,
    rdma, nic_affinity, device_node, disk), C(gpu) and C(message).
  returned: always
  type: list
  elements: dict
gpu_facts:
  description: Parsed facts.
  returned: always
  type: dict
  contains:
    count:
      description: Number of GPUs nvidia-smi lists.
      type: int
    driver_version:
      description: Driver version.
      type: str
    cuda_version:
      description: Highest CUDA version the driver supports.
      type: str
    product_names:
      description: Distinct product names.
      type: list
    gpus:
      description: One dict per GPU (index, pci_bus_id, product_name, uuid, persistence_mode, mig_mode_current,
        ecc_mode_current, ecc_volatile_uncorrectable, ecc_aggregate_uncorrectable, retired_pages_pending,
        remapped_rows_pending, remapped_rows_failure, fabric_state, fabric_status, nvlink_active,
        nvlink_inactive, ...).
      type: list
    topology:
      description: C(nvidia-smi topo -m) parsed (matrix, gpu_nic links by NIC name, nic_names, cpu/numa affinity).
      type: dict
    rdma_devices:
      description: RDMA devices with their ports' state, link layer and rate.
      type: dict
    disk:
      description: path, checked_path (nearest existing parent), free_bytes, total_bytes.
      type: dict
"""

import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402  (after the documentation, as in community.general)
from ansible_collections.b300.pd.plugins.module_utils import gpu_facts as gf  # noqa: E402


def _first_line(text):
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def probe(module):
    """Run the probes through module.run_command; return the facts dict that gf.check_gpus() reads."""
    p = module.params
    facts = {"smi": None, "nvlink": None, "topology": None, "smi_error": None, "nvlink_error": None,
             "rdma_dir": p["rdma_sysfs_dir"], "rdma": gf.read_rdma_devices(p["rdma_sysfs_dir"])}
    if not p["probe_gpu"]:
        return facts
    smi = p["nvidia_smi"]
    if "/" in smi:
        path = smi if os.access(smi, os.X_OK) else None
    else:
        path = module.get_bin_path(smi, required=False)
    if not path:
        facts["smi_error"] = "nvidia-smi not found" if smi == "nvidia-smi" else f"{smi} not found"
        return facts
    # A GPU that fell off the bus can hang nvidia-smi for good: bound every call with coreutils' timeout.
    limit = p["command_timeout"]
    timeout_bin = module.get_bin_path("timeout", required=False)
    prefix = [timeout_bin, "-k", "10", str(limit)] if timeout_bin else []

    def call(*args):
        rc, out, err = module.run_command(prefix + [path, *args])
        what = "nvidia-smi " + " ".join(args)
        if prefix and rc in (124, 137):
            return None, (f"{what} timed out after {limit} s (a GPU may have fallen off the bus: "
                          "look for Xid 79 in dmesg)")
        if rc != 0:
            return None, f"{what} failed (rc {rc}): {_first_line(err) or _first_line(out)}"
        return out, None

    out, facts["smi_error"] = call("-q", "-x")
    if out is None:
        return facts
    try:
        facts["smi"] = gf.parse_smi_xml(out)
    except Exception as e:  # ElementTree.ParseError and friends: report, do not crash
        facts["smi_error"] = f"cannot parse nvidia-smi -q -x output: {e}"
        return facts
    out, facts["nvlink_error"] = call("nvlink", "-s")
    if out is not None:
        facts["nvlink"] = gf.parse_nvlink_status(out)
    out, error = call("topo", "-m")
    facts["topology"] = gf.parse_topo_matrix(out) if out is not None else {"error": error}
    return facts


def run_module():
    module = AnsibleModule(
        argument_spec=dict(
            probe_gpu=dict(type="bool", default=True),
            gpu_skip_reason=dict(type="str", default="GPU checks not requested"),
            nvidia_smi=dict(type="str", default="nvidia-smi"),
            command_timeout=dict(type="int", default=120),
            expected_product=dict(type="str", default=""),
            expected_count=dict(type="int", default=0),
            min_driver_version=dict(type="str", default=""),
            require_fabric=dict(type="bool", default=False),
            require_nvlink=dict(type="bool", default=False),
            require_persistence=dict(type="bool", default=False),
            require_ecc=dict(type="bool", default=False),
            rdma_devices=dict(type="list", elements="str", default=[]),
            instances=dict(type="list", elements="dict", default=[]),
            nic_affinity_links=dict(type="list", elements="str", default=["PIX", "PXB"]),
            rdma_sysfs_dir=dict(type="path", default="/sys/class/infiniband"),
            check_device_nodes=dict(type="bool", default=False),
            dev_dir=dict(type="path", default="/dev"),
            require_imex_channels=dict(type="bool", default=False),
            disk_path=dict(type="path"),
            disk_min_free_bytes=dict(type="int", default=0),
        ),
        supports_check_mode=True,
    )
    p = module.params
    facts = probe(module)
    expect = {
        "product": p["expected_product"], "count": p["expected_count"], "driver_min": p["min_driver_version"],
        "require_fabric": p["require_fabric"], "require_nvlink": p["require_nvlink"],
        "require_persistence": p["require_persistence"], "require_ecc": p["require_ecc"],
        "rdma_devices": p["rdma_devices"],
    }
    if p["probe_gpu"]:
        details = gf.check_gpus(facts, expect)
        if facts["smi"] and facts["smi"]["gpus"]:
            details += gf.check_nic_affinity(facts["topology"], gf.instance_nics(p["instances"]),
                                             p["nic_affinity_links"])
    else:
        details = gf.check_rdma(facts, expect)
    if p["check_device_nodes"]:
        details += gf.check_device_nodes(facts, p["dev_dir"], p["rdma_devices"], p["require_imex_channels"])
    disk = None
    if p["disk_path"]:
        try:
            disk = gf.disk_free(p["disk_path"])
            details += gf.check_disk(disk, p["disk_min_free_bytes"])
        except OSError as e:
            details.append({"kind": "disk", "gpu": None, "message": "cannot measure free space of {}: {}".format(
                p["disk_path"], e)})
    result = gf.summarize(facts, disk)
    if not p["probe_gpu"]:
        skip_reason = p["gpu_skip_reason"]
    elif facts["smi"] is None:
        skip_reason = facts["smi_error"]
    elif not facts["smi"]["gpus"]:
        skip_reason = "nvidia-smi lists 0 GPUs"
    else:
        skip_reason = ""
    module.exit_json(
        changed=False,
        gpu_present=bool(facts["smi"] and facts["smi"]["gpus"]),
        gpu_skip_reason=skip_reason,
        gpu_facts=result,
        problems=[d["message"] for d in details],
        problem_details=details,
    )


def main():
    run_module()


if __name__ == "__main__":
    main()
