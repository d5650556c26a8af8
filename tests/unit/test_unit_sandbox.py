"""The vLLM unit's sandbox: `systemd-analyze security --offline=yes` scores every rendered unit at <= 2.5.

The units are rendered as tests/unit/test_golden_recipe.py renders them (the b300 inventory with the CUDA build's
entry point, the embedded default with the CPU build's), written as <name>.service (systemd-analyze reads the unit
type from the suffix) and scored offline: no systemd manager, the User= need not exist. main's unit scored 8.5.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from ansible_collections.b300.pd.plugins.module_utils import pd_recipe, pd_unit
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory

PYTHON = "/opt/vllm/current/bin/python"
MAX_EXPOSURE = 2.5
# The JITs (torch.compile, Triton, CUDA) need W+X memory; the GPUs and HCAs are devices; NVML and vLLM read non-pid
# files of /proc; device nodes and /dev/shm peers are owned by real ids.
FORBIDDEN = ("MemoryDenyWriteExecute", "PrivateDevices", "PrivateUsers", "ProcSubset")
REQUIRED = (
    "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes",
    "ProtectClock=yes", "ProtectHostname=yes", "LockPersonality=yes", "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes", "RestrictNamespaces=yes",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK", "CapabilityBoundingSet=",
    "AmbientCapabilities=", "SystemCallArchitectures=native", "ProtectSystem=strict", "UMask=0027",
    "DevicePolicy=closed", "NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectHome=yes",
)
GPU_DEVICE_GROUPS = ("char-nvidia rw", "char-nvidiactl rw", "char-nvidia-uvm rw", "char-nvidia-caps rw")


def _units():
    out = []
    for name in ("b300", "local"):
        inv = load_inventory(name)
        for host, hv in inv["hosts"].items():
            for inst in hv["pd_instances"]:
                # as vllm_serve renders them: with the workers' key file and the firewall's unit required
                unit = pd_unit.render_unit(inv["recipe"], inst, PYTHON, "vllm",
                                           vllm_package=inv["group_vars"]["pd_vllm_package"],
                                           api_key_file="/etc/vllm/api-key.env",
                                           requires_units=["pd-firewall.service"])
                out.append(pytest.param(inv["recipe"], inst, unit, id=f"{name}/{host}/{inst['name']}"))
    return out


UNITS = _units()


def _analyzer_supports_offline():
    exe = shutil.which("systemd-analyze")
    if not exe:
        return False
    helptext = subprocess.run([exe, "security", "--help"], capture_output=True, text=True, check=False).stdout
    return "--offline" in helptext and "--threshold" in helptext


def exposure(unit_text, tmp_path, name="vllm-test.service"):
    """Overall exposure of a unit file (0.0 .. 10.0) and the analyzer's exit status at threshold 2.5."""
    path = tmp_path / name
    path.write_text(unit_text)
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}", "--no-pager",
         str(path)], capture_output=True, text=True, check=False, cwd=tmp_path)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m, f"no overall exposure in systemd-analyze's output:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return float(m.group(1)), proc.returncode, proc.stdout


def directives(unit_text):
    return [line for line in unit_text.splitlines() if "=" in line and not line.startswith(("#", " "))]


@pytest.mark.skipif(not _analyzer_supports_offline(), reason="systemd-analyze without security --offline/--threshold "
                    "(needs systemd >= 250)")
@pytest.mark.parametrize(("recipe", "inst", "unit"), UNITS)
def test_unit_exposure_is_at_most_2_5(tmp_path, recipe, inst, unit):
    score, rc, report = exposure(unit, tmp_path, f"{pd_recipe.unit_name(inst)}")
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE}:\n{report}"
    assert rc == 0, report


@pytest.mark.skipif(not _analyzer_supports_offline(), reason="systemd-analyze without security --offline")
def test_exposure_check_can_fail(tmp_path):
    """The measurement is real: the same unit without its sandbox scores far above 2.5."""
    _recipe, inst, unit = UNITS[0].values
    bare = "\n".join(x for x in unit.splitlines()
                     if x.split("=", 1)[0] not in {d.split("=", 1)[0] for d in pd_unit.UNIT_SANDBOX}
                     and not x.startswith(("DeviceAllow=", "ReadWritePaths="))) + "\n"
    score, rc, _stdout = exposure(bare, tmp_path)
    assert score > MAX_EXPOSURE and rc != 0


@pytest.mark.parametrize(("recipe", "inst", "unit"), UNITS)
def test_unit_sandbox_directives(recipe, inst, unit):
    lines = directives(unit)
    keys = {x.split("=", 1)[0] for x in lines}
    assert not keys & set(FORBIDDEN), sorted(keys & set(FORBIDDEN))
    for want in REQUIRED:
        assert want in lines, want
    allowed = [x.split("=", 1)[1] for x in lines if x.startswith("DeviceAllow=")]
    for group in (*GPU_DEVICE_GROUPS, "char-infiniband_verbs rw"):
        assert group in allowed, group
    # every section of the unit is [Unit], [Service] or [Install]: nothing above smuggled one in
    assert [x for x in unit.splitlines() if x.startswith("[")] == ["[Unit]", "[Service]", "[Install]"]


@pytest.mark.parametrize(("recipe", "inst", "unit"), UNITS)
def test_only_state_and_shm_are_writable_and_the_model_is_not(recipe, inst, unit):
    rw = next(x for x in directives(unit) if x.startswith("ReadWritePaths=")).split("=", 1)[1].split()
    assert rw == ["/var/lib/vllm", "/dev/shm"]
    model = recipe["pd_model_path"]
    assert not any(model.startswith(p.lstrip("-").rstrip("/") + "/") for p in rw)
    # the instance's HOME and caches (build_env) are under the writable state root
    env = pd_recipe.build_env(recipe, inst, "192.0.2.1")
    for key in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[key].startswith("/var/lib/vllm/"), key


def test_a_cache_moved_by_the_env_becomes_writable():
    inv = load_inventory("b300")
    recipe = dict(inv["recipe"], pd_vllm_env={**inv["recipe"]["pd_vllm_env"], "TRITON_CACHE_DIR": "/scratch/triton"})
    inst = dict(inv["hosts"]["b300-01"]["pd_instances"][0], extra_env={"HF_HOME": "/var/lib/vllm/shared/hf"})
    assert pd_unit.unit_writable_paths(recipe, inst) == ["/var/lib/vllm", "/dev/shm", "-/scratch/triton"]
    unit = pd_unit.render_unit(recipe, inst, PYTHON, "vllm")
    assert "ReadWritePaths=/var/lib/vllm /dev/shm -/scratch/triton" in unit.splitlines()


@pytest.mark.parametrize("path", ["/mnt/model/glm", "/mnt/model/glm/cache", "/mnt", "/"])
def test_a_cache_in_the_model_directory_is_refused(path):
    inv = load_inventory("b300")
    inst = dict(inv["hosts"]["b300-01"]["pd_instances"][0], extra_env={"VLLM_CACHE_ROOT": path})
    with pytest.raises(pd_recipe.RecipeError, match=r"field extra_env\.VLLM_CACHE_ROOT: .* model directory"):
        pd_unit.render_unit(inv["recipe"], inst, PYTHON, "vllm")
