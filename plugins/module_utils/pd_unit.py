# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The systemd unit of one vLLM instance: its ExecStart (systemd quoting), its sandbox and render_unit().

Pure functions, no I/O: the words the unit runs come from plugins/module_utils/pd_recipe.py (serve_command,
build_argv), so the unit and the parser check always see the same argv. Used by plugins/modules/vllm_instance.py.
"""

from __future__ import annotations

import posixpath
import re

from ansible_collections.b300.pd.plugins.module_utils import pd_input_rules as rules
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import (
    CONSOLE_SCRIPT_DISTRIBUTION,
    DEFAULT_ENV_DIR,
    DEFAULT_STATE_ROOT,
    RecipeError,
    build_argv,
    build_flags,
    env_file_path,
    instance_label,
    serve_command,
    state_dir,
    unit_name,
)

_NEEDS_QUOTES = re.compile(r"""[\s'"\\;%$]""")


def systemd_quote(word):
    """Quote one ExecStart word for systemd (systemd.service(5) "Command lines", systemd.syntax(7))."""
    word = str(word)
    escaped = word.replace("%", "%%").replace("$", "$$")
    if word and not _NEEDS_QUOTES.search(word):
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace("'", "\\'")
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t")
    return f"'{escaped}'"


def shutdown_timeout(flags):
    value = flags.get("shutdown-timeout")
    if value in (None, False):
        return 0
    try:
        return int(float(value))
    except (TypeError, ValueError):
        raise RecipeError(f"field shutdown-timeout: must be a number of seconds, got {value!r}") from None


# The vLLM unit's sandbox (docs/security.md). Scored by `systemd-analyze security` at <= 2.5 (tests/unit/
# test_unit_sandbox.py). Left out on purpose: MemoryDenyWriteExecute (torch.compile, Triton and CUDA JIT write code),
# PrivateDevices (hides the GPUs and HCAs), PrivateUsers (device nodes and /dev/shm peers are owned by real ids),
# ProcSubset=pid (NVML and vLLM read /proc/driver/nvidia, /proc/cpuinfo, /proc/meminfo), PrivateIPC (UCX's sysv/cma
# transports reach the other instances of the host, which run in other units).
UNIT_SANDBOX = (
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "PrivateMounts=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "LockPersonality=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "RestrictNamespaces=yes",
    # NETLINK: libibverbs and NVML ask the kernel for RDMA links and interfaces over netlink.
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "SystemCallArchitectures=native",
    # A deny list, not @system-service: an allow list also refuses every system call newer than the host's systemd
    # knows, and CUDA/NCCL/UCX pick up new ones. Denied: what needs a capability the unit no longer has, plus
    # ptrace/perf (@debug: one instance must not read another's memory), minus pidfd_getfd, with which FlashInfer's
    # NVLink all-to-all imports the CUDA memory handles of its peer ranks.
    "SystemCallFilter=~@clock @cpu-emulation @debug @module @mount @obsolete @raw-io @reboot @swap",
    "SystemCallFilter=pidfd_getfd",
    # EPERM instead of SIGSYS: a library probing a denied call gets an error it can handle, not a dead engine.
    "SystemCallErrorNumber=EPERM",
    "UMask=0027",
    "DevicePolicy=closed",
)
# Device groups as /proc/devices names them (DeviceAllow=char-<name> allows that major, all minors). GPUs: major 195
# is "nvidia" + "nvidiactl" with the open kernel modules (Blackwell) and "nvidia-frontend" with the older proprietary
# ones: /dev/nvidia[0-9]*, /dev/nvidiactl, /dev/nvidia-modeset. "nvidia-uvm": /dev/nvidia-uvm and -uvm-tools.
# "nvidia-caps": /dev/nvidia-caps/* (MIG). "nvidia-caps-imex-channels": NVLink fabric memory handles.
# RDMA: "infiniband_verbs" (/dev/infiniband/uverbs*, UCX rc); rdma_cm is a misc device (major 10), so by path. A group
# the host does not have (the CPU build's hosts) is skipped by systemd; DevicePolicy=closed keeps /dev/null, zero,
# full, random, urandom, tty, ptmx. Not allowed: nvidia-nvswitch / nvidia-nvlink (fabric manager's), gdrdrv, knem,
# xpmem (not in the recipe's UCX_TLS).
UNIT_DEVICE_ALLOW = (
    "char-nvidia rw",
    "char-nvidiactl rw",
    "char-nvidia-frontend rw",
    "char-nvidia-uvm rw",
    "char-nvidia-caps rw",
    "char-nvidia-caps-imex-channels rw",
    "char-infiniband_verbs rw",
    "/dev/infiniband/rdma_cm rw",
)
# Environment variables naming directories vLLM, torch, Triton, FlashInfer, CUDA or Hugging Face write to. build_env
# puts them under the instance's state dir; one that the recipe points elsewhere is made writable in the unit
# (ProtectSystem=strict), so the env stays the one place that says where caches live.
UNIT_WRITABLE_ENV = (
    "HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "CUDA_CACHE_PATH", "TMPDIR",
)


def unit_writable_paths(recipe, instance, state_root=DEFAULT_STATE_ROOT):
    """ReadWritePaths of the unit: the state root, /dev/shm, and cache dirs the env moves out of the state root."""
    root = state_root.rstrip("/") or "/"
    paths = [root, "/dev/shm"]
    model_dir = posixpath.dirname(str(recipe.get("pd_model_path") or "").rstrip("/"))
    for field, env in (("pd_vllm_env", recipe.get("pd_vllm_env")), ("pd_ucx_env", recipe.get("pd_ucx_env")),
                       ("extra_env", instance.get("extra_env"))):
        for key in UNIT_WRITABLE_ENV:
            value = (env or {}).get(key)
            if not isinstance(value, str) or not value.startswith("/"):
                continue  # relative: under WorkingDirectory, the state dir
            # A space would add a second path to the list (ReadWritePaths=... -/srv/x /etc), a quote or `..` more.
            rules.check_abs_path(f"{instance_label(instance)}, field {field}.{key}", value)
            path = posixpath.normpath(value)
            if path == root or path.startswith(root + "/") or path in paths:
                continue
            if path == "/" or (model_dir and (model_dir.startswith(path.rstrip("/") + "/") or model_dir == path
                                              or path.startswith(model_dir + "/"))):
                raise RecipeError(
                    f"{instance_label(instance)}, field {field}.{key}: {value!r} would make the model directory "
                    f"{model_dir} writable for vLLM; point it outside {model_dir}, e.g. under {root}")
            # "-": a missing dir does not stop the unit from starting; vLLM then names the path it cannot create.
            paths.append(f"-{path}")
    return paths


def render_unit(
    recipe,
    instance,
    python,
    user,
    *,
    group=None,
    env_dir=DEFAULT_ENV_DIR,
    state_root=DEFAULT_STATE_ROOT,
    restart_sec=30,
    stop_grace_s=30,
    vllm_package=CONSOLE_SCRIPT_DISTRIBUTION,
    model_path=None,
    api_key_file=None,
    requires_units=(),
):
    """The systemd unit text of one instance (model_path: see build_argv).

    api_key_file: the env file holding VLLM_API_KEY (pd_recipe.api_key_env_path), read by systemd at start, after
    the instance's env file; without its `-` prefix a missing key file stops the unit instead of serving open.
    requires_units: units the instance needs running first (Requires= and After=, e.g. pd-firewall.service).
    """
    group = group or user
    requires = [rules.check_name(f"requires_units[{i}]", u) for i, u in enumerate(requires_units or ())]
    if api_key_file is not None:
        rules.check_abs_path("api_key_file", api_key_file)
    command = serve_command(python, vllm_package)
    argv = build_argv(recipe, instance, model_path)
    flags = build_flags(recipe, instance)
    stop_timeout = shutdown_timeout(flags) + int(stop_grace_s)
    home = state_dir(instance, state_root)
    state_rel = home[len("/var/lib/"):] if home.startswith("/var/lib/") else None
    name = instance["name"]
    gpus = instance.get("gpus") or []
    desc = (
        f"vLLM {instance['pool']} instance {name} ({recipe.get('pd_served_model_name')}, "
        f"TP{instance['tp_size']} DP{instance['dp_size']}, {len(gpus)} GPU{'s' if len(gpus) != 1 else ''})"
    )
    # The command and the model on the first line, then a flag and its value per continuation line.
    cmd_lines = [" ".join(systemd_quote(w) for w in [*command, argv[0]])]
    i = 1
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            cmd_lines.append(f"{systemd_quote(argv[i])} {systemd_quote(argv[i + 1])}")
            i += 2
        else:
            cmd_lines.append(systemd_quote(argv[i]))
            i += 1
    exec_start = " \\\n    ".join(cmd_lines)
    lines = [
        f"# Managed by Ansible (b300-pd vllm_serve): {unit_name(instance)}. Do not edit; change the inventory.",
        "[Unit]",
        f"Description={desc}",
        "Documentation=https://docs.vllm.ai/",
        "After=network-online.target nvidia-fabricmanager.service nvidia-persistenced.service",
        "Wants=network-online.target",
        *([f"Requires={' '.join(requires)}", f"After={' '.join(requires)}"] if requires else []),
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        f"Group={group}",
        f"EnvironmentFile={env_file_path(instance, env_dir)}",
        *([f"EnvironmentFile={api_key_file}"] if api_key_file else []),
        f"WorkingDirectory={home}",
    ]
    if state_rel:
        lines += [f"StateDirectory={state_rel}", "StateDirectoryMode=0750"]
    lines += [
        f"ExecStart={exec_start}",
        "Restart=on-failure",
        f"RestartSec={int(restart_sec)}",
        "TimeoutStartSec=infinity",
        f"TimeoutStopSec={stop_timeout}",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=1048576",
        *UNIT_SANDBOX,
        *(f"DeviceAllow={d}" for d in UNIT_DEVICE_ALLOW),
        f"ReadWritePaths={' '.join(unit_writable_paths(recipe, instance, state_root))}",
        f"SyslogIdentifier=vllm-{name}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"
