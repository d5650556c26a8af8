"""Unit tests of roles/rdma_nixl/files/nixl_transport_check.py: which shared libraries a process maps both from
NIXL's wheel and from the system (`loaded_twice`), the cause of a SIGSEGV at exit on hosts with rdma-core.

The /proc/<pid>/maps lines are real: a NIXL 1.5.1 (nixl-cu13) agent with the UCX backend on a Debian 12 test
host with rdma-core 44 installed, UCX_TLS=tcp,self,sm, UCX_MODULES unset.
"""

from __future__ import annotations

from pathlib import Path

from ansible_collections.b300.pd.roles.rdma_nixl.files import nixl_transport_check as ntc

ROOT = Path(__file__).resolve().parents[2]

LIBS = "/opt/vllm/venvs/molecule/lib/python3.11/site-packages/nixl_cu13.libs"
SYS = "/usr/lib/x86_64-linux-gnu"
MAPS = f"""\
7f8043600000-7f8043621000 r-xp 00000000 00:5c 7070818                    {LIBS}/libnl-3-47cd035c.so.200.26.0
7f8043e00000-7f8043e87000 r-xp 00000000 00:5c 7070819                    {LIBS}/libnl-route-3-3ad497a3.so.200.26.0
7f804476f000-7f804478e000 r--p 00000000 00:5c 6466020                    {SYS}/libnl-route-3.so.200.26.0
7f8044800000-7f804481f000 r-xp 00000000 00:5c 7070816                    {LIBS}/libibverbs-1de1263b.so.1.14.48.0
7f8045005000-7f804500d000 r--p 00000000 00:5c 6466002                    {SYS}/libnl-3.so.200.26.0
7f8045028000-7f804502f000 r--p 00000000 00:5c 6466025                    {SYS}/libibverbs.so.1.14.44.0
7f8045049000-7f804504b000 r--p 00000000 00:5c 6466030                    {SYS}/libefa.so.1.2.44.0
7f8045057000-7f804505b000 r--p 00000000 00:5c 7070869                    {LIBS}/ucx/libuct_ib_efa.so.0.0.0
7f80451ad000-7f80451c2000 r--p 00000000 00:5c 7070826                    {LIBS}/libucs-14c218c5.so.0.0.0
7f806872c000-7f8068752000 r--p 00000000 00:5c 5351649                    {SYS}/libc.so.6
7f806877f000-7f8068780000 rw-p 00000000 00:00 0
7ffd1c1d4000-7ffd1c1f5000 rw-p 00000000 00:00 0                          [stack]
"""


def test_lib_name_drops_auditwheel_hash_and_version():
    assert ntc._lib_name(f"{LIBS}/libnl-route-3-3ad497a3.so.200.26.0") == "libnl-route-3"
    assert ntc._lib_name("/usr/lib/x86_64-linux-gnu/libnl-route-3.so.200.26.0") == "libnl-route-3"
    assert ntc._lib_name(f"{LIBS}/libibverbs-1de1263b.so.1.14.48.0") == "libibverbs"
    # a name whose last part is not an 8-hex-digit hash keeps it
    assert ntc._lib_name("/usr/lib/libfoo-bar.so.1") == "libfoo-bar"


def test_loaded_twice_names_the_system_copies_of_the_wheels_libraries():
    twice = ntc.loaded_twice(MAPS, LIBS)
    assert [t["name"] for t in twice] == ["libibverbs", "libnl-3", "libnl-route-3"]
    assert twice[2] == {"name": "libnl-route-3", "bundled": f"{LIBS}/libnl-route-3-3ad497a3.so.200.26.0",
                        "system": f"{SYS}/libnl-route-3.so.200.26.0"}


def test_loaded_twice_empty_without_system_copies():
    # UCX_MODULES=^efa: libuct_ib_efa, libefa and the system libibverbs/libnl are not mapped.
    maps = "\n".join(line for line in MAPS.splitlines()
                     if f"{SYS}/lib" not in line or "libc.so" in line)
    assert ntc.loaded_twice(maps, LIBS) == []
    assert ntc.loaded_twice("", LIBS) == []


def test_loaded_twice_bundled_dir_with_trailing_slash_and_sibling_dir():
    assert len(ntc.loaded_twice(MAPS, LIBS + "/")) == 3
    # a directory that merely starts with the same characters is not the wheel's
    assert ntc.loaded_twice(MAPS.replace("nixl_cu13.libs/", "nixl_cu13.libsX/"), LIBS) == []
