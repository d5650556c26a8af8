#!/usr/bin/env python3
"""Report which UCX transports NIXL can use on this host; exit 1 when NIXL cannot initialise UCX.

Run with the vLLM venv's python (NIXL lives there). Steps:
  1. import nixl and create an agent with no backends, check that the UCX plugin is available;
  2. create the UCX backend (what vLLM's NixlConnector does) and read its memory types;
  3. with the UCX library bundled in NIXL's wheel, read UCX's config from the environment (UCX_TLS,
     UCX_NET_DEVICES, ...), initialise a UCP context and list its transport resources (transport/device),
     which is what `ucx_info -d` would show for that configuration;
  4. every transport named in UCX_TLS (aliases expanded: rc, ud, dc, sm, cuda, ...) must have at least one
     resource, otherwise the instances would silently fall back or fail at the first KV transfer;
  5. list the shared libraries mapped both from NIXL's wheel and from the system (`loaded_twice`): UCX's efa
     module (libuct_ib_efa) links the system libefa, which brings the system libibverbs/libnl-3/libnl-route-3
     next to the wheel's own copies, and the process then crashes at exit (SIGSEGV in libnl-route's
     destructor). The role fails on the exit status; this list says why.
Prints one JSON object on stdout. Only reads; changes nothing.
"""
import ctypes
import glob
import importlib.metadata
import json
import os
import re
import sys
import tempfile

# UCX_TLS aliases -> transport names as they appear in UCX resources (ucx_info -d "Transport:").
ALIASES = {
    "rc": ["rc_verbs", "rc_mlx5"],
    "rc_v": ["rc_verbs"],
    "rc_x": ["rc_mlx5"],
    "ud": ["ud_verbs", "ud_mlx5"],
    "ud_v": ["ud_verbs"],
    "ud_x": ["ud_mlx5"],
    "dc": ["dc_mlx5"],
    "dc_x": ["dc_mlx5"],
    "ib": ["rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5"],
    "sm": ["posix", "sysv", "cma", "knem", "xpmem"],
    "shm": ["posix", "sysv", "cma", "knem", "xpmem"],
    "mm": ["posix", "sysv", "xpmem"],
    "cuda": ["cuda_copy", "cuda_ipc", "gdr_copy"],
}


def wanted_transports(ucx_tls):
    """UCX_TLS entries that must be backed by a resource: [(entry, [accepted transports])]."""
    out = []
    for entry in (e.strip() for e in ucx_tls.split(",")):
        if not entry or entry.startswith("^") or entry == "all":
            continue
        name = entry.split(":", 1)[0]
        out.append((entry, ALIASES.get(name, [name])))
    return out


def ucx_resources(libdir):
    """(ucx_version, [(transport, device)]) from a UCP context, using libucp from NIXL's wheel."""
    libs = sorted(glob.glob(os.path.join(libdir, "libucp*.so*")))
    if not libs:
        raise RuntimeError(f"no libucp in {libdir}")
    ucp = ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    config = ctypes.c_void_p()
    status = ucp.ucp_config_read(None, None, ctypes.byref(config))
    if status != 0:
        raise RuntimeError(f"ucp_config_read failed (status {status}): check the UCX_* environment")
    params = (ctypes.c_uint64 * 64)()  # ucp_params_t, zeroed; only field_mask + features are set
    params[0] = 1  # UCP_PARAM_FIELD_FEATURES
    params[1] = 0x1 | 0x2 | 0x8  # UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_AM
    context = ctypes.c_void_p()
    status = ucp.ucp_init_version(major, minor, params, config, ctypes.byref(context))
    ucp.ucp_config_release(config)
    if status != 0:
        raise RuntimeError(f"ucp_init failed (status {status}): no usable UCX transport for this "
                           "UCX_TLS/UCX_NET_DEVICES")
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    fd, path = tempfile.mkstemp(prefix="ucx-info-")
    os.close(fd)
    try:
        stream = libc.fopen(path.encode(), b"w")
        ucp.ucp_context_print_info(context, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    finally:
        os.unlink(path)
        ucp.ucp_cleanup(context)
    return f"{major.value}.{minor.value}.{release.value}", parse_resources(text)


def parse_resources(text):
    """[(transport, device)] from ucp_context_print_info output."""
    resources = []
    for line in text.splitlines():
        # "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0"
        m = re.match(r"^#\s+resource\s+\d+\s*:.*--\s*(\S+?)/(\S+)\s*$", line)
        if m:
            resources.append((m.group(1), m.group(2)))
    return resources


def _lib_name(path):
    """'/x/nixl_cu13.libs/libnl-route-3-3ad497a3.so.200.26.0' -> 'libnl-route-3' (auditwheel's hash dropped)."""
    name = os.path.basename(path).split(".so", 1)[0]
    return re.sub(r"-[0-9a-f]{8}$", "", name)


def loaded_twice(maps_text, bundled_dir):
    """Library names mapped both from under `bundled_dir` (NIXL's wheel) and from elsewhere, from
    /proc/<pid>/maps text: [{"name", "bundled", "system"}], sorted by name."""
    bundled_dir = bundled_dir.rstrip("/") + "/"
    bundled, other = {}, {}
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/") or ".so" not in os.path.basename(fields[5]):
            continue
        path = fields[5].strip()
        (bundled if path.startswith(bundled_dir) else other).setdefault(_lib_name(path), path)
    return [{"name": n, "bundled": bundled[n], "system": other[n]} for n in sorted(set(bundled) & set(other))]


def missing_transports(ucx_tls, transports):
    """UCX_TLS entries with no usable transport among `transports`."""
    have = set(transports)
    return [entry for entry, accepted in wanted_transports(ucx_tls) if not set(accepted) & have]


def main():
    report = {"ok": False, "ucx_tls": os.environ.get("UCX_TLS", ""),
              "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", ""), "python": sys.executable}
    try:
        import nixl  # noqa: PLC0415  (the import is part of what is checked)
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415

        pkg = getattr(nixl, "_pkg", None)
        report["nixl_version"] = importlib.metadata.version("nixl")
        report["nixl_package"] = pkg.__name__ if pkg else "nixl"
        agent = nixl_agent(f"pd-transport-check-{os.getpid()}", nixl_agent_config(backends=[]))
        plugins = list(agent.get_plugin_list())
        report["nixl_plugins"] = plugins
        if "UCX" not in plugins:
            raise RuntimeError(f"NIXL has no UCX plugin (plugins: {', '.join(plugins) or 'none'})")
        agent.create_backend("UCX")
        report["ucx_backend"] = "initialised"
        report["ucx_mem_types"] = list(agent.backend_mems.get("UCX", []))
        libdir = os.path.join(os.path.dirname(os.path.dirname(pkg.__file__)), f"{pkg.__name__}.libs") if pkg else ""
        report["ucx_version"], resources = ucx_resources(libdir)
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            report["loaded_twice"] = loaded_twice(f.read(), os.path.realpath(libdir))
        report["resources"] = [f"{tl}/{dev}" for tl, dev in resources]
        transports = sorted({tl for tl, _dev in resources})
        report["transports"] = transports
        missing = missing_transports(report["ucx_tls"], transports)
        report["missing"] = missing
        if missing:
            raise RuntimeError(
                f"UCX_TLS lists {', '.join(missing)} but UCX has no such usable transport here "
                f"(usable: {', '.join(transports) or 'none'})")
        report["ok"] = True
    except Exception as exc:  # noqa: BLE001  (reported as JSON, exit 1)
        report["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
