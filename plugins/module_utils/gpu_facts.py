# Shared logic of plugins/modules/gpu_facts.py: parsers for nvidia-smi output and the checks against expectations.
# Pure functions over text (no I/O except the sysfs/disk readers, which take their paths as arguments), so the
# unit tests feed them real captures from tests/fixtures/gpu/.
from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

from ansible_collections.b300.pd.plugins.module_utils.model_disk_space import human_bytes, statvfs_nearest

NA_VALUES = ("", "n/a", "[n/a]", "not supported", "[not supported]", "unknown", "[unknown error]", "none")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _text(node, path, default=None):
    """Text of the first element at `path` under `node`, stripped; `default` when missing."""
    if node is None:
        return default
    el = node.find(path)
    if el is None or el.text is None:
        return default
    return el.text.strip()


def is_na(value):
    return value is None or str(value).strip().lower() in NA_VALUES


def _int_or_none(value):
    if is_na(value):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def _yes(value):
    return not is_na(value) and str(value).strip().lower() in ("yes", "true", "enabled")


def version_tuple(version):
    """'580.159.03' -> (580, 159, 3); non-numeric parts end the tuple. '' -> ()."""
    parts = []
    for part in str(version or "").strip().split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        parts.append(int(m.group(0)))
    return tuple(parts)


def version_at_least(found, minimum):
    f, m = version_tuple(found), version_tuple(minimum)
    if not f:
        return False
    width = max(len(f), len(m))
    return f + (0,) * (width - len(f)) >= m + (0,) * (width - len(m))


def _ecc_uncorrectable(node):
    """Sum of uncorrectable ECC counters under <volatile> or <aggregate>.

    Handles both schemas nvidia-smi has used: the older one (<double_bit><total>) and the one of recent
    drivers (<sram_uncorrectable_parity>, <sram_uncorrectable_secded>, <dram_uncorrectable>, ...).
    Returns None when no counter is a number (ECC off, N/A).
    """
    if node is None:
        return None
    total, seen = 0, False
    for el in node.iter():
        tag = el.tag.lower()
        if "uncorrectable" in tag and "threshold" not in tag:
            value = _int_or_none(el.text)
            if value is not None:
                total += value
                seen = True
    value = _int_or_none(_text(node, "double_bit/total"))
    if value is not None:
        total += value
        seen = True
    return total if seen else None


def parse_smi_xml(xml_text):
    """Parse `nvidia-smi -q -x` into a dict: driver/cuda versions and one entry per GPU."""
    root = ET.fromstring(xml_text)  # noqa: S314  (output of the local nvidia-smi, not untrusted input)
    gpus = []
    for index, gpu in enumerate(root.findall("gpu")):
        ecc = gpu.find("ecc_errors")
        retired = gpu.find("retired_pages")
        remapped = gpu.find("remapped_rows")
        fabric = gpu.find("fabric")
        mig = gpu.find("mig_mode")
        mem_total = _text(gpu, "fb_memory_usage/total")
        gpus.append({
            "index": index,
            "minor_number": _int_or_none(_text(gpu, "minor_number")),
            "pci_bus_id": gpu.get("id") or _text(gpu, "pci/pci_bus_id"),
            "product_name": _text(gpu, "product_name", ""),
            "product_architecture": _text(gpu, "product_architecture", ""),
            "uuid": _text(gpu, "uuid", ""),
            "serial": _text(gpu, "serial", ""),
            "vbios_version": _text(gpu, "vbios_version", ""),
            "memory_total": mem_total,
            "persistence_mode": _text(gpu, "persistence_mode", "N/A"),
            "mig_mode_current": _text(mig, "current_mig", "N/A"),
            "mig_mode_pending": _text(mig, "pending_mig", "N/A"),
            "ecc_mode_current": _text(gpu, "ecc_mode/current_ecc", "N/A"),
            "ecc_mode_pending": _text(gpu, "ecc_mode/pending_ecc", "N/A"),
            "ecc_volatile_uncorrectable": _ecc_uncorrectable(ecc.find("volatile") if ecc is not None else None),
            "ecc_aggregate_uncorrectable": _ecc_uncorrectable(ecc.find("aggregate") if ecc is not None else None),
            "ecc_sram_threshold_exceeded": _yes(_text(ecc, "aggregate/sram_threshold_exceeded")),
            "retired_pages_pending": _yes(_text(retired, "pending_retirement") or _text(retired, "pending_blacklist")),
            "retired_pages_sbe": _int_or_none(_text(retired, "multiple_single_bit_retirement/retired_count")),
            "retired_pages_dbe": _int_or_none(_text(retired, "double_bit_retirement/retired_count")),
            "remapped_rows_correctable": _int_or_none(_text(remapped, "remapped_row_corr")),
            "remapped_rows_uncorrectable": _int_or_none(_text(remapped, "remapped_row_unc")),
            "remapped_rows_pending": _yes(_text(remapped, "remapped_row_pending")),
            "remapped_rows_failure": _yes(_text(remapped, "remapped_row_failure")),
            "channel_repair_pending": _yes(_text(ecc, "channel_repair_pending")),
            "tpc_repair_pending": _yes(_text(ecc, "tpc_repair_pending")),
            "unrepairable_memory": _yes(_text(ecc, "unrepairable_memory")),
            "fabric_state": _text(fabric, "state", "N/A"),
            "fabric_health_summary": _text(fabric, "health/summary", "N/A"),
            "fabric_status": _text(fabric, "status", "N/A"),
            "fabric_clique_id": _text(fabric, "cliqueId") or _text(fabric, "clique_id") or "N/A",
            "fabric_cluster_uuid": _text(fabric, "clusterUuid") or _text(fabric, "cluster_uuid") or "N/A",
        })
    return {
        "driver_version": _text(root, "driver_version", ""),
        "cuda_version": _text(root, "cuda_version", ""),
        "attached_gpus": _int_or_none(_text(root, "attached_gpus")),
        "gpus": gpus,
    }


_NVLINK_GPU = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*(?:\(UUID:\s*([^)]*)\))?\s*$")
_NVLINK_LINK = re.compile(r"^\s*Link\s+(\d+):\s*(.+?)\s*$")


def parse_nvlink_status(text):
    """Parse `nvidia-smi nvlink -s` into {gpu_index: {"active": n, "inactive": n, "links": {...}}}.

    A link line reads 'Link 0: 26.562 GB/s' when up and 'Link 0: <inactive>' when down.
    """
    result = {}
    current = None
    for line in _ANSI.sub("", text or "").splitlines():
        m = _NVLINK_GPU.match(line.strip())
        if m:
            current = int(m.group(1))
            result[current] = {"name": m.group(2), "uuid": m.group(3) or "", "active": 0, "inactive": 0,
                               "links": {}}
            continue
        m = _NVLINK_LINK.match(line)
        if m and current is not None:
            state = m.group(2)
            up = "inactive" not in state.lower() and not is_na(state)
            result[current]["links"][int(m.group(1))] = state
            result[current]["active" if up else "inactive"] += 1
    return result


def parse_topo_matrix(text):
    """Parse `nvidia-smi topo -m`: the matrix between GPUs and NICs, CPU/NUMA affinity, and the NIC legend.

    Returns {"devices": [...], "matrix": {row: {col: link}}, "cpu_affinity": {gpu: str},
    "numa_affinity": {gpu: str}, "nic_names": {"NIC0": "mlx5_0"}, "gpu_nic": {gpu: {nic_name: link}}}.
    """
    lines = [_ANSI.sub("", ln).rstrip() for ln in (text or "").splitlines()]
    header, devices, extra_cols = None, [], []
    matrix, cpu_aff, numa_aff, nic_names = {}, {}, {}, {}
    for line in lines:
        if header is None:
            cols = [c.strip() for c in line.split("\t") if c.strip()]
            if cols and re.match(r"^(GPU|NIC)\d+$", cols[0]):
                header = cols
                devices = [c for c in cols if re.match(r"^(GPU|NIC)\d+$", c)]
                extra_cols = cols[len(devices):]
            continue
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if m:
            nic_names[m.group(1)] = m.group(2)
            continue
        cells = [c.strip() for c in line.split("\t")]
        cells = [c for c in cells if c != ""]
        if not cells or not re.match(r"^(GPU|NIC)\d+$", cells[0]):
            continue
        row, values = cells[0], cells[1:]
        matrix[row] = {devices[i]: values[i] for i in range(min(len(devices), len(values)))}
        rest = values[len(devices):]
        for i, value in enumerate(rest[:len(extra_cols)]):  # no zip(strict=): hosts may run Python < 3.10
            name = extra_cols[i]
            if name.lower().startswith("cpu affinity"):
                cpu_aff[row] = value
            elif name.lower().startswith("numa affinity"):
                numa_aff[row] = value
    gpu_nic = {}
    for row, links in matrix.items():
        if row.startswith("GPU"):
            gpu_nic[row] = {nic_names.get(col, col): link for col, link in links.items() if col.startswith("NIC")}
    return {"devices": devices, "matrix": matrix, "cpu_affinity": cpu_aff, "numa_affinity": numa_aff,
            "nic_names": nic_names, "gpu_nic": gpu_nic}


def read_rdma_devices(sysfs_dir):
    """RDMA devices under /sys/class/infiniband: {name: {"ports": {n: {"state", "link_layer", "rate"}}}}."""
    devices = {}
    if not os.path.isdir(sysfs_dir):
        return devices
    for name in sorted(os.listdir(sysfs_dir)):
        ports = {}
        pdir = os.path.join(sysfs_dir, name, "ports")
        if os.path.isdir(pdir):
            for port in sorted(os.listdir(pdir)):
                info = {}
                for key in ("state", "link_layer", "rate", "phys_state"):
                    try:
                        with open(os.path.join(pdir, port, key)) as f:
                            info[key] = f.read().strip()
                    except OSError:
                        info[key] = ""
                ports[port] = info
        devices[name] = {"ports": ports}
    return devices


def rdma_port_active(dev_info, port=None):
    for pnum, info in dev_info.get("ports", {}).items():
        if port is not None and str(pnum) != str(port):
            continue
        if "ACTIVE" in info.get("state", "").upper():
            return True
    return False


def disk_free(path):
    """Free bytes for `path`, measured on its nearest existing parent (the model root may not exist yet)."""
    checked, st = statvfs_nearest(path)
    return {"path": path, "checked_path": checked, "free_bytes": st.f_bavail * st.f_frsize,
            "total_bytes": st.f_blocks * st.f_frsize}


def _problem(kind, message, gpu=None):
    return {"kind": kind, "gpu": gpu, "message": message}


def _gpu_label(g):
    return "GPU {} ({})".format(g["index"], g.get("pci_bus_id") or g.get("uuid") or "?")


def check_gpus(facts, expect):
    """Compare parsed facts with expectations; return a list of problem dicts {kind, gpu, message}.

    facts: {"smi": parse_smi_xml(...) or None, "nvlink": parse_nvlink_status(...) or None,
            "rdma": read_rdma_devices(...), "smi_error": str or None, "nvlink_error": str or None}
    expect: product, count, driver_min, require_fabric, require_persistence, require_ecc, require_nvlink,
            rdma_devices (list of "mlx5_0" or "mlx5_0:1").
    """
    problems = []
    product = expect.get("product") or ""
    count = expect.get("count")
    want = "{} x {}".format(count if count else "any", product or "NVIDIA GPU")
    smi = facts.get("smi")
    if smi is None:
        problems.append(_problem("no_gpu", f"expected {want}, found no NVIDIA GPU ({facts.get('smi_error')})"))
        return problems + check_rdma(facts, expect)
    gpus = smi["gpus"]
    if not gpus:
        problems.append(_problem("no_gpu", f"expected {want}, found no NVIDIA GPU (nvidia-smi lists 0 GPUs)"))
        return problems + check_rdma(facts, expect)
    if count and len(gpus) != int(count):
        names = sorted({g["product_name"] for g in gpus})
        problems.append(_problem("count", f"expected {count} GPUs, found {len(gpus)} ({', '.join(names)})"))
    if product:
        wrong = [g for g in gpus if product.lower() not in g["product_name"].lower()]
        if wrong:
            found = sorted({g["product_name"] for g in wrong})
            problems.append(_problem(
                "product", "expected product '{}', found '{}' on {} of {} GPUs ({})".format(
                    product, "', '".join(found), len(wrong), len(gpus),
                    ", ".join(str(g["index"]) for g in wrong))))
    driver_min = expect.get("driver_min")
    if driver_min and not version_at_least(smi["driver_version"], driver_min):
        problems.append(_problem("driver", "driver {} is older than the minimum {}".format(
            smi["driver_version"] or "unknown", driver_min)))
    for g in gpus:
        label = _gpu_label(g)
        if expect.get("require_persistence") and g["persistence_mode"].lower() != "enabled":
            problems.append(_problem("persistence", "{}: persistence mode is {}, need Enabled "
                                     "(nvidia-persistenced)".format(label, g["persistence_mode"]), g["index"]))
        if g["mig_mode_current"].lower() == "enabled" or g["mig_mode_pending"].lower() == "enabled":
            problems.append(_problem("mig", "{}: MIG mode is {} (pending {}), must be Disabled".format(
                label, g["mig_mode_current"], g["mig_mode_pending"]), g["index"]))
        if expect.get("require_ecc") and g["ecc_mode_current"].lower() != "enabled":
            problems.append(_problem("ecc_mode", "{}: ECC mode is {}, need Enabled".format(
                label, g["ecc_mode_current"]), g["index"]))
        if g["ecc_volatile_uncorrectable"]:
            problems.append(_problem("ecc_errors", f"{label}: {g['ecc_volatile_uncorrectable']} volatile "
                                     "uncorrectable ECC errors since the last driver load", g["index"]))
        if g["ecc_sram_threshold_exceeded"]:
            problems.append(_problem("ecc_errors", f"{label}: SRAM uncorrectable ECC threshold exceeded (RMA "
                                     "candidate)", g["index"]))
        if g["retired_pages_pending"]:
            problems.append(_problem("retired_pages", f"{label}: page retirement pending, reset the GPU",
                                     g["index"]))
        if g["remapped_rows_pending"]:
            problems.append(_problem("remapped_rows", f"{label}: row remapping pending, reset the GPU",
                                     g["index"]))
        if g["remapped_rows_failure"]:
            problems.append(_problem("remapped_rows", f"{label}: row remapping failed (RMA candidate)",
                                     g["index"]))
        if g["channel_repair_pending"] or g["tpc_repair_pending"]:
            problems.append(_problem("repair_pending", f"{label}: memory channel / TPC repair pending, reset the GPU",
                                     g["index"]))
        if g["unrepairable_memory"]:
            problems.append(_problem("unrepairable_memory", f"{label}: unrepairable memory reported (RMA candidate)",
                                     g["index"]))
        if expect.get("require_fabric"):
            state, status = g["fabric_state"], g["fabric_status"]
            if state.lower() != "completed" or status.lower() != "success":
                problems.append(_problem("fabric", f"{label}: NVLink fabric state {state} / status {status}, "
                                         "need Completed / Success (nvidia-fabricmanager / NVLink subnet manager)",
                                         g["index"]))
    if expect.get("require_nvlink"):
        nvl = facts.get("nvlink")
        if nvl is None:
            problems.append(_problem("nvlink", "NVLink status unavailable ({})".format(facts.get("nvlink_error"))))
        else:
            for g in gpus:
                links = nvl.get(g["index"])
                if not links or links["active"] == 0:
                    problems.append(_problem("nvlink", f"{_gpu_label(g)}: no active NVLink link", g["index"]))
                elif links["inactive"]:
                    down = sorted(n for n, s in links["links"].items() if "inactive" in s.lower() or is_na(s))
                    problems.append(_problem("nvlink", "{}: {} NVLink links inactive ({})".format(
                        _gpu_label(g), links["inactive"], ", ".join(str(n) for n in down)), g["index"]))
    return problems + check_rdma(facts, expect)


def check_rdma(facts, expect):
    problems = []
    rdma = facts.get("rdma") or {}
    wanted = list(expect.get("rdma_devices") or [])
    if wanted and not rdma:
        return [_problem("rdma", "expected RDMA devices {}, found none in {} (no RDMA driver / NIC)".format(
            ", ".join(wanted), facts.get("rdma_dir", "/sys/class/infiniband")))]
    for want in wanted:
        name, _sep, port = str(want).partition(":")
        if name not in rdma:
            problems.append(_problem("rdma", "RDMA device {} not found in {} (have: {})".format(
                name, facts.get("rdma_dir", "/sys/class/infiniband"), ", ".join(sorted(rdma)) or "none")))
        elif not rdma_port_active(rdma[name], port or None):
            problems.append(_problem("rdma", "RDMA device {} port {} is not ACTIVE ({})".format(
                name, port or "any", "; ".join("{}: {}".format(p, i.get("state")) for p, i in
                                               rdma[name]["ports"].items()) or "no ports")))
    return problems


def check_disk(disk, min_free_bytes):
    if min_free_bytes and disk["free_bytes"] < int(min_free_bytes):
        return [_problem("disk", "{} free on {} (for {}), need {}".format(
            human_bytes(disk["free_bytes"]), disk["checked_path"], disk["path"], human_bytes(int(min_free_bytes))))]
    return []


def summarize(facts, disk=None):
    """The `gpu_facts` return value: parsed GPUs with their NVLink counts, topology, RDMA and disk."""
    smi = facts.get("smi") or {"gpus": [], "driver_version": "", "cuda_version": ""}
    nvl = facts.get("nvlink") or {}
    gpus = []
    for parsed in smi["gpus"]:
        links = nvl.get(parsed["index"])
        gpus.append(dict(parsed, nvlink_active=links["active"] if links else None,
                         nvlink_inactive=links["inactive"] if links else None))
    return {
        "count": len(gpus),
        "driver_version": smi["driver_version"],
        "cuda_version": smi["cuda_version"],
        "product_names": sorted({g["product_name"] for g in gpus}),
        "gpus": gpus,
        "nvlink_error": facts.get("nvlink_error"),
        "topology": facts.get("topology"),
        "rdma_devices": facts.get("rdma") or {},
        "disk": disk,
    }


def check_nic_affinity(topology, instances, links=("PIX", "PXB")):
    """Every GPU of an instance must reach one of the instance's UCX NICs through its own PCIe switch.

    instances: [{"name", "gpus": [int], "nics": ["mlx5_0", ...]}]; `links` are the topo -m relations accepted
    (PIX, PXB: same PCIe switch). A GPU whose listed NICs are all NODE/SYS away sends its KV blocks across the
    CPU root complex or the socket interconnect. Skipped (no problem) when topo -m lists no NIC: the RDMA check
    reports missing devices.
    """
    if not instances:
        return []
    if not topology or topology.get("error"):
        return [_problem("nic_affinity", "cannot check GPU/NIC affinity: "
                         + ((topology or {}).get("error") or "no nvidia-smi topo -m output"))]
    if not topology.get("nic_names"):
        return []
    accepted = {str(x).upper() for x in links}
    problems = []
    for inst in instances:
        nics = [str(n).partition(":")[0] for n in inst.get("nics") or []]
        for gpu in inst.get("gpus") or []:
            row = topology["gpu_nic"].get(f"GPU{gpu}")
            if row is None:
                problems.append(_problem("nic_affinity", f"instance {inst.get('name')}: GPU {gpu} is not in "
                                         "nvidia-smi topo -m", gpu))
                continue
            if any(row.get(n, "").upper() in accepted for n in nics):
                continue
            near = sorted(n for n, link in row.items() if link.upper() in accepted)
            seen = ", ".join(f"{n}: {row.get(n, 'not in topo')}" for n in nics)
            problems.append(_problem(
                "nic_affinity",
                f"instance {inst.get('name')}: GPU {gpu} has none of its ucx_net_devices behind its PCIe switch "
                f"({seen}); near it: {', '.join(near) or 'no NIC'}", gpu))
    return problems


def instance_nics(instances):
    """pd_instances entries -> [{"name", "gpus", "nics"}] for those that set ucx_net_devices."""
    out = []
    for inst in instances or []:
        devices = inst.get("ucx_net_devices")
        if not devices:
            continue
        if isinstance(devices, str):
            devices = devices.split(",")
        out.append({"name": inst.get("name", "?"), "gpus": [int(g) for g in inst.get("gpus") or []],
                    "nics": [str(d).strip().partition(":")[0] for d in devices if str(d).strip()]})
    return out


# Device nodes the sandboxed vLLM unit opens (plugins/module_utils/pd_unit.py UNIT_DEVICE_ALLOW,
# docs/security.md). The unit has no capability and ProtectKernelModules: it cannot load nvidia-uvm or let
# nvidia-modprobe (setuid) create a
# missing node, so CUDA would fail at start with no device. Each missing node is one problem naming its fix.
_FIX_NVIDIA = ("the driver's nodes are made by nvidia-persistenced (roles/nvidia_driver) or, as root, by "
               "`nvidia-modprobe -c {minor}` (with /dev/nvidiactl)")
_FIX_UVM = "load the UVM module and make its nodes as root: `nvidia-modprobe -u -c=0` (at boot: a oneshot unit)"
_FIX_CAPS = ("MIG is enabled: make the MIG capability nodes as root (`nvidia-modprobe -f "
             "/proc/driver/nvidia/capabilities/mig/config`) or disable MIG (`nvidia-smi -mig 0`)")
_FIX_IMEX = ("make IMEX channel 0 as root (`nvidia-modprobe -i 0:1`), or load nvidia with "
             "NVreg_CreateImexChannel0=1")
_FIX_UVERBS = "load the verbs module as root (`modprobe ib_uverbs`; rdma-core's rdma-load-modules does it at boot)"


def _node_problem(path, fix, gpu=None):
    return _problem("device_node", f"device node {path} missing: {fix}", gpu)


def check_device_nodes(facts, dev_dir="/dev", rdma_devices=(), require_imex=False):
    """Problems for the GPU and RDMA device nodes a sandboxed vLLM unit needs that do not exist under dev_dir.

    GPU nodes are those of every GPU nvidia-smi lists (/dev/nvidia<minor>; the minor number, not the index), plus
    /dev/nvidiactl and /dev/nvidia-uvm; /dev/nvidia-caps/ when a GPU runs MIG; /dev/nvidia-caps-imex-channels/channel0
    when require_imex; /dev/infiniband/uverbs<N> of every RDMA device in rdma_devices that sysfs lists (a device
    missing from sysfs is check_rdma's problem).
    """
    problems = []
    gpus = (facts.get("smi") or {}).get("gpus") or []
    if gpus:
        first = gpus[0]["index"] if gpus[0].get("minor_number") is None else gpus[0]["minor_number"]
        for name, fix in (("nvidiactl", _FIX_NVIDIA.format(minor=first)), ("nvidia-uvm", _FIX_UVM)):
            if not os.path.exists(os.path.join(dev_dir, name)):
                problems.append(_node_problem(os.path.join(dev_dir, name), fix))
        for g in gpus:
            minor = g.get("minor_number")
            minor = g["index"] if minor is None else minor
            path = os.path.join(dev_dir, f"nvidia{minor}")
            if not os.path.exists(path):
                problems.append(_node_problem(path, _FIX_NVIDIA.format(minor=minor), g["index"]))
        caps = os.path.join(dev_dir, "nvidia-caps")
        mig = [g["index"] for g in gpus if str(g.get("mig_mode_current", "")).lower() == "enabled"]
        if mig and not (os.path.isdir(caps) and any(n.startswith("nvidia-cap") for n in os.listdir(caps))):
            problems.append(_node_problem(caps + "/nvidia-cap*", _FIX_CAPS, mig[0]))
        if require_imex:
            channel = os.path.join(dev_dir, "nvidia-caps-imex-channels", "channel0")
            if not os.path.exists(channel):
                problems.append(_node_problem(channel, _FIX_IMEX))
    rdma = facts.get("rdma") or {}
    sysfs = facts.get("rdma_dir", "/sys/class/infiniband")
    for name in sorted({str(d).partition(":")[0] for d in rdma_devices}):
        if name not in rdma:
            continue
        verbs_dir = os.path.join(sysfs, name, "device", "infiniband_verbs")
        verbs = sorted(os.listdir(verbs_dir)) if os.path.isdir(verbs_dir) else []
        if not verbs:
            problems.append(_problem("device_node", f"RDMA device {name} has no verbs device ({verbs_dir} is empty "
                                     f"or missing): {_FIX_UVERBS}"))
        for uverbs in verbs:
            path = os.path.join(dev_dir, "infiniband", uverbs)
            if not os.path.exists(path):
                problems.append(_node_problem(path, f"verbs device of {name}; {_FIX_UVERBS}"))
    return problems
