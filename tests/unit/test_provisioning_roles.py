"""Unit tests of the provisioning roles' helpers.

- roles/rdma_nixl/files/nixl_transport_check.py: UCX_TLS alias expansion, parsing of UCP's resource listing
  (the real text format of ucp_context_print_info, UCX 1.23), and the missing-transport decision.
- molecule/_aptrepo/build.sh: the dummy NVIDIA repository has the package relationships the Molecule
  scenarios rely on (exact-version dependencies, branch conflicts, a newer version than each pin) and a
  valid signature. Skipped when dpkg-deb/apt-ftparchive/gpg/gcc are missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from ansible_collections.b300.pd.roles.rdma_nixl.files import nixl_transport_check as ntc

ROOT = Path(__file__).resolve().parents[2]

# Output of ucp_context_print_info on a host with UCX_TLS unset (captured with the libucp of nixl-cu12 1.5.1).
UCP_INFO = """#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 5  :  ib
#
#            md 0  :  component 0  self
#            md 1  :  component 1  tcp
#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 1  dev 2  flags -- tcp/lo
#      resource 3  :  md 2  dev 0  flags -- sysv/memory
#      resource 4  :  md 3  dev 0  flags -- posix/memory
#      resource 5  :  md 5  dev 3  flags -- rc_mlx5/mlx5_0:1
#
"""


def test_parse_resources_reads_transport_and_device():
    assert ntc.parse_resources(UCP_INFO) == [
        ("self", "memory"), ("tcp", "eth0"), ("tcp", "lo"), ("sysv", "memory"), ("posix", "memory"),
        ("rc_mlx5", "mlx5_0:1"),
    ]


def test_parse_resources_ignores_components_and_mds():
    assert ntc.parse_resources("#     component 0  :  self\n#            md 0  :  component 0  self\n") == []


@pytest.mark.parametrize(("ucx_tls", "expected"), [
    ("tcp,self,sm", [("tcp", ["tcp"]), ("self", ["self"]), ("sm", ["posix", "sysv", "cma", "knem", "xpmem"])]),
    ("rc,cuda_copy", [("rc", ["rc_verbs", "rc_mlx5"]), ("cuda_copy", ["cuda_copy"])]),
    ("^ud,all,,", []),
    ("rc_x:aux", [("rc_x:aux", ["rc_mlx5"])]),
])
def test_wanted_transports(ucx_tls, expected):
    assert ntc.wanted_transports(ucx_tls) == expected


def test_missing_transports_b300_recipe_on_host_without_rdma():
    have = ["self", "tcp", "sysv", "posix", "cma"]
    assert ntc.missing_transports("rc,cuda_copy,cuda_ipc,sm,self", have) == ["rc", "cuda_copy", "cuda_ipc"]


def test_missing_transports_none_when_aliases_are_covered():
    have = ["self", "rc_mlx5", "posix", "cuda_copy", "cuda_ipc"]
    assert ntc.missing_transports("rc,cuda_copy,cuda_ipc,sm,self", have) == []
    assert ntc.missing_transports("", have) == []


TOOLS = ["dpkg-deb", "apt-ftparchive", "gpg", "gcc", "dpkg"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    if missing := [t for t in TOOLS if not shutil.which(t)]:
        pytest.skip(f"missing {missing}")
    out = tmp_path_factory.mktemp("aptrepo")
    subprocess.run([str(ROOT / "molecule/_aptrepo/build.sh"), str(out)], check=True, capture_output=True)
    return out


def _packages(repo):
    stanzas = (repo / "repo/Packages").read_text().strip().split("\n\n")
    out = {}
    for s in stanzas:
        fields = dict(line.split(": ", 1) for line in s.splitlines() if ": " in line and not line.startswith(" "))
        out.setdefault(fields["Package"], {})[fields["Version"]] = fields
    return out


def test_repo_fabricmanager_and_nscq_depend_on_exact_driver(repo):
    pkgs = _packages(repo)
    for branch in ("570", "580"):
        for name in (f"nvidia-fabricmanager-{branch}", f"libnvidia-nscq-{branch}"):
            for version, fields in pkgs[name].items():
                assert fields["Depends"] == f"nvidia-driver-{branch}-open (= {version})"


def test_repo_branches_conflict(repo):
    pkgs = _packages(repo)
    assert all(f["Conflicts"] == "nvidia-driver-570-open" for f in pkgs["nvidia-driver-580-open"].values())
    assert all(f["Conflicts"] == "nvidia-driver-580-open" for f in pkgs["nvidia-driver-570-open"].values())


def test_repo_has_newer_versions_than_scenario_pins(repo):
    """The scenarios pin 580.105.08 / nvlsm 2025.10.4 / cuda 13.0.2: each needs a newer version to resist."""
    pkgs = _packages(repo)

    def newer(a, b):
        return subprocess.run(["dpkg", "--compare-versions", a, "gt", b], check=False).returncode == 0

    for name, pin in [("nvidia-driver-580-open", "580.105.08-1"), ("nvidia-fabricmanager-580", "580.105.08-1"),
                      ("nvidia-persistenced", "580.105.08-1"), ("nvlsm", "2025.10.4-1"),
                      ("cuda-toolkit-13-0", "13.0.2-1")]:
        assert pin in pkgs[name], f"{name} {pin} missing"
        assert any(newer(v, pin) for v in pkgs[name]), f"{name}: nothing newer than {pin}"


def test_repo_inrelease_signed_by_exported_key(repo, tmp_path):
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    env = {"GNUPGHOME": str(home), "PATH": "/usr/bin:/bin"}
    subprocess.run(["gpg", "--batch", "--import", str(repo / "repo/key.asc")],
                   check=True, env=env, capture_output=True)
    ok = subprocess.run(["gpg", "--batch", "--verify", str(repo / "repo/InRelease")], check=False, env=env,
                        capture_output=True)
    assert ok.returncode == 0, ok.stderr
    tampered = tmp_path / "InRelease"
    tampered.write_text((repo / "repo/InRelease").read_text().replace("Packages", "Packagez", 1))
    bad = subprocess.run(["gpg", "--batch", "--verify", str(tampered)], check=False, env=env, capture_output=True)
    assert bad.returncode != 0
