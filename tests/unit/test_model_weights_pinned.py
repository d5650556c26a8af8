"""Weights pinned at the control node (issue #32): the manifest (file list + hashes) is taken once, on the control
node, from the hub's listing or the first verified download, and every host - the seed of the peer copy included -
checks its bytes against it; a seed whose file differs is refused, naming host and file.

The hub is a local stdlib HTTP server speaking the hub's API (test_model_weights.Server); the peer copy is real rsync
between two local roots (as test_model_weights' peer test and test_peer_copy.py do); the role runs through
ansible-playbook on two local "hosts".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm
from ansible_collections.b300.pd.tests.unit.pd_testlib import ROOT
from ansible_collections.b300.pd.tests.unit.test_model_weights import Server, args_for, make_model, run

REV = "c0ffee" + "0" * 34  # a hub commit id: not a hash of the file list, so the list cannot vouch for itself
SHARD = "model-00001-of-00002.safetensors"
LFS = {SHARD, "model-00002-of-00002.safetensors"}

needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync not installed")


@pytest.fixture
def hub(tmp_path):
    d = tmp_path / "hub"
    make_model(d, revision=REV)
    srv = Server(d, hub={"repo": "org/glm", "rev": REV, "api_sha": REV, "lfs": LFS})
    yield srv
    srv.close()


def hf_source(srv):
    return {"type": "hf", "repo_id": "org/glm", "endpoint": srv.url}


def pin_args(tmp_path, source, **kw):
    pin = tmp_path / "control" / ".cache" / "weights" / f"org--glm@{REV}.manifest.json"
    return args_for(tmp_path / "control", source, REV, pin=str(pin), **kw), pin


def pinned_from_hub(tmp_path, srv, monkeypatch):
    """The control node's pin step: the hub's listing, written once."""
    args, pin = pin_args(tmp_path, hf_source(srv))
    res, failed = run(args, monkeypatch)
    assert not failed, res
    return res["manifest"], pin


def compromise(revdir: Path, target: str):
    """What a compromised seed host does: change a file, add code, and write a manifest.json agreeing with both."""
    if target == "config.json":
        (revdir / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "evil.AutoModel"}}))
    else:
        data = bytearray((revdir / target).read_bytes())
        data[100] ^= 0xFF  # same size: only the sha256 can tell
        (revdir / target).write_bytes(bytes(data))
    (revdir / "evil.py").write_text("import os\nos.system('id > /tmp/owned')\n")
    (revdir / "manifest.json").write_text(mm.dumps_manifest(mm.build_manifest(revdir, revision=REV)))


# ------------------------------------------------------------------ the seed's changed file, over real rsync


@needs_rsync
@pytest.mark.parametrize("target", ["config.json", SHARD])
def test_a_seed_with_a_changed_file_is_refused_by_every_other_host(tmp_path, hub, monkeypatch, target):
    pinned, _pin = pinned_from_hub(tmp_path, hub, monkeypatch)
    seed = tmp_path / "b300-01"
    seed.mkdir()
    res, failed = run(args_for(seed, hf_source(hub), REV, manifest=pinned), monkeypatch)
    assert not failed and res["pinned"] and res["summary"] == {"fetched": 4}, res
    seed_rev = seed / "root" / "revisions" / REV
    compromise(seed_rev, target)

    for host in ("b300-02", "b300-03"):
        (tmp_path / host).mkdir()
        args = args_for(tmp_path / host, {"type": "peer", "name": "b300-01", "path": str(seed_rev)}, REV,
                        manifest=pinned)
        res, failed = run(args, monkeypatch)
        assert failed, res
        assert f"refused {target} from host b300-01 ({seed_rev})" in res["msg"], res["msg"]
        assert "does not match the manifest pinned on the control node" in res["msg"], res["msg"]
        revdir = tmp_path / host / "root" / "revisions" / REV
        assert not (revdir / target).exists(), "the changed file never lands in the revision directory"
        assert not (revdir / "evil.py").exists(), "a file the pin does not list is never copied"
        assert not (tmp_path / host / "root" / "served").exists(), "nothing is served"

    # The same seed without a pin (what main did: the seed's manifest.json is the authority): the changed file and
    # the added code are served. This is the attack the pin closes.
    (tmp_path / "old").mkdir()
    res, failed = run(args_for(tmp_path / "old", {"type": "peer", "path": str(seed_rev)}, REV), monkeypatch)
    assert not failed, res
    assert (tmp_path / "old" / "root" / "served" / "evil.py").exists()


@needs_rsync
def test_the_seed_itself_is_checked_against_the_pin(tmp_path, hub, monkeypatch):
    warnings = []
    monkeypatch.setattr(basic.AnsibleModule, "warn", lambda self, msg: warnings.append(msg))
    pinned, _pin = pinned_from_hub(tmp_path, hub, monkeypatch)
    seed = tmp_path / "b300-01"
    seed.mkdir()
    args = args_for(seed, hf_source(hub), REV, manifest=pinned)
    assert not run(args, monkeypatch)[1]
    compromise(seed / "root" / "revisions" / REV, "config.json")
    res, failed = run(args, monkeypatch, check=True)
    assert not failed and res["changed"], res
    states = {f["path"]: f["state"] for f in res["files"]}
    assert states["config.json"] == mm.SIZE_MISMATCH and res["removed"] == ["evil.py"], res
    assert any("differs from the manifest pinned on the control node" in w for w in warnings), warnings
    res, failed = run(args, monkeypatch)
    assert not failed, res
    assert {f["path"]: f["state"] for f in res["files"]}["config.json"] == mm.REPAIRED
    served = seed / "root" / "served"
    assert not (served / "evil.py").exists()
    assert (served / "config.json").read_bytes() == (tmp_path / "hub" / "config.json").read_bytes()
    # Its manifest.json is the pin's again (with sha256 for the hub's non-LFS files).
    local = json.loads((served / "manifest.json").read_text())
    assert mm.manifest_differences(local, pinned) == [] and all("sha256" in f for f in local["files"])


@needs_rsync
def test_a_good_seed_serves_every_host_with_the_pin(tmp_path, hub, monkeypatch):
    pinned, _pin = pinned_from_hub(tmp_path, hub, monkeypatch)
    seed = tmp_path / "b300-01"
    seed.mkdir()
    assert not run(args_for(seed, hf_source(hub), REV, manifest=pinned), monkeypatch)[1]
    seed_rev = seed / "root" / "revisions" / REV
    # The seed's manifest.json is not read at all: even a broken one does not matter.
    (seed_rev / "manifest.json").write_text("{")
    (tmp_path / "b300-02").mkdir()
    args = args_for(tmp_path / "b300-02", {"type": "peer", "name": "b300-01", "path": str(seed_rev)}, REV,
                    manifest=pinned)
    res, failed = run(args, monkeypatch)
    assert not failed and res["summary"] == {"fetched": 4}, res
    assert res["manifest_origin"] == (f"host b300-01 ({seed_rev}), checked against the manifest pinned on the "
                                      "control node")
    assert run(args, monkeypatch)[0]["changed"] is False


# ------------------------------------------------------------------ pin mode on the control node


def test_pin_mode_pins_the_hub_listing_once(tmp_path, hub, monkeypatch):
    args, pin = pin_args(tmp_path, hf_source(hub))
    res, failed = run(args, monkeypatch, check=True)
    assert not failed and res["changed"] and res["pinned"], res
    assert not pin.exists(), "check mode writes no pin"
    res, failed = run(args, monkeypatch)
    assert not failed and res["changed"], res
    on_disk = json.loads(pin.read_text())
    assert on_disk == res["manifest"] and on_disk["revision"] == REV
    by_path = {f["path"]: f for f in on_disk["files"]}
    assert set(by_path) == {SHARD, "model-00002-of-00002.safetensors", "config.json", "tokenizer/tokenizer.json"}
    assert "sha256" in by_path[SHARD] and "git_sha1" in by_path["config.json"]
    assert not (tmp_path / "control" / "root").exists(), "pin mode touches no model root"
    # Pinned once: the hub is not asked again, and a hub that changes afterwards changes nothing.
    asked = len(hub.auth_seen)
    (tmp_path / "hub" / "config.json").write_text("{}")
    res, failed = run(args, monkeypatch)
    assert not failed and res["changed"] is False and res["manifest"] == on_disk
    assert len(hub.auth_seen) == asked


def test_pin_mode_refuses_a_damaged_pin(tmp_path, hub, monkeypatch):
    args, pin = pin_args(tmp_path, hf_source(hub))
    assert not run(args, monkeypatch)[1]
    pin.write_text(pin.read_text().replace(REV, "d" * 40, 1))
    res, failed = run(args, monkeypatch)
    assert failed and f"the pinned manifest {pin} is not usable" in res["msg"] and "delete it" in res["msg"], res


def test_pin_mode_for_a_path_source_pins_the_first_verified_download(tmp_path, monkeypatch):
    d = tmp_path / "src"
    m = make_model(d, revision=REV)
    args, pin = pin_args(tmp_path, {"type": "path", "path": str(d)})
    res, failed = run(args, monkeypatch)
    assert not failed and res["pinned"] is False and res["manifest"] is None and not pin.exists(), res
    (tmp_path / "seed").mkdir()
    first, failed = run(args_for(tmp_path / "seed", {"type": "path", "path": str(d)}, REV), monkeypatch)
    assert not failed
    res, failed = run(dict(args, manifest=first["manifest"]), monkeypatch)
    assert not failed and res["changed"] and json.loads(pin.read_text()) == m, res
    # Another download that differs from what is pinned is refused.
    other = json.loads(json.dumps(m))
    other["files"][0]["sha256"] = "0" * 64
    res, failed = run(dict(args, manifest=other), monkeypatch)
    assert failed and "differs from the manifest pinned in" in res["msg"], res
    assert json.loads(pin.read_text()) == m


def test_a_pinned_manifest_of_another_revision_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "src"
    m = make_model(d, revision=REV)
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, REV, manifest=dict(m, revision="e" * 40)),
                      monkeypatch)
    assert failed and "pinned on the control node" in res["msg"] and "delete it" in res["msg"], res
    assert not (tmp_path / "root").exists()


# ------------------------------------------------------------------ the role: every host checks against the pin


def test_the_role_hands_every_fetch_the_pinned_manifest():
    tasks = yaml.safe_load((ROOT / "roles" / "model_weights" / "tasks" / "fetch.yml").read_text())
    fetches = [t for t in tasks if "b300.pd.model_weights" in t and "pin" not in t["b300.pd.model_weights"]]
    first = [t for t in fetches if t["name"].startswith("Start the first verified download")]
    assert len(first) == 1 and "not _model_weights_pin_read.pinned" in first[0]["when"]
    for t in fetches:
        if t not in first:
            assert "_model_weights_manifest" in t["b300.pd.model_weights"].get("manifest", ""), t["name"]
    peer = next(t for t in fetches if t["name"].startswith("Start copying"))
    assert peer["b300.pd.model_weights"]["source"]["name"] == "{{ model_weights_seed_host }}"
    pins = [t for t in tasks if "pin" in t.get("b300.pd.model_weights", {})]
    assert pins and all(t["delegate_to"] == "localhost" and t["run_once"] and t["become"] is False for t in pins)


def _role_run(tmp: Path, hostvars: dict, extra: dict, tasks_from: str = "main"):
    inv = tmp / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {
        h: {"ansible_connection": "local", "ansible_python_interpreter": shutil.which("python3"), **v}
        for h, v in hostvars.items()}}}))
    pb = tmp / "site.yml"
    # tasks_from fetch: the fetch alone (no package install, no peer ssh setup: the fan-out test brings its own ssh).
    pb.write_text("- name: Model weights\n  hosts: all\n  gather_facts: false\n  tasks:\n"
                  "    - name: Model weights\n      ansible.builtin.include_role:\n"
                  f"        name: b300.pd.model_weights\n        tasks_from: {tasks_from}\n")
    (tmp / "vars.json").write_text(json.dumps({"model_weights_async_timeout": 600, "model_weights_async_poll": 1,
                                               "pd_vllm_user": "nobody", "model_weights_space_margin_mib": 0,
                                               "pd_model_peer_fanout": False, "pd_control_dir": str(tmp / "control"),
                                               **extra}))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_CACHE_PLUGIN="memory")
    cmd = [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inv), "-e", f"@{tmp / 'vars.json'}", str(pb)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=900)  # noqa: S603
    failed = {h: int(n) for h, n in re.findall(r"^(\S+)\s*:\s*ok=\d+\s+changed=\d+\s+unreachable=\d+\s+failed=(\d+)",
                                               p.stdout, re.M)}
    assert set(failed) == set(hostvars), p.stdout[-3000:] + p.stderr[-3000:]
    return p, failed


@pytest.fixture
def world_readable_tmp():
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="model-weights-pin-", dir="/var/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_role_pins_the_first_download_and_every_host_checks_against_it(world_readable_tmp):
    tmp = world_readable_tmp
    src = tmp / "src"
    make_model(src, revision=REV)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    source = {"type": "path", "path": str(src), "revision": REV}
    hosts = {h: {"pd_model_root": str(tmp / h), "pd_model_path": str(tmp / h / "tiny-pd")} for h in ("h1", "h2")}
    # As the shipped inventories set it: "{{ inventory_dir }}/../.."
    source_vars = {"pd_model_source": source,
                   "pd_control_dir": str(tmp / "inventory" / "local" / ".." / ".." / "control")}
    p, failed = _role_run(tmp, hosts, source_vars)
    assert failed == {"h1": 0, "h2": 0}, p.stdout[-4000:]
    pin = tmp / "control" / ".cache" / "weights" / f"tiny-pd@{REV}.manifest.json"
    pinned = json.loads(pin.read_text())
    assert pinned == json.loads((src / "manifest.json").read_text())
    for h in hosts:
        assert (tmp / h / "tiny-pd" / "config.json").read_bytes() == (src / "config.json").read_bytes()

    # The source changes after the pin (files and manifest.json agreeing): a host that must fetch refuses it, naming
    # the file; a host that already holds the pinned bytes keeps them.
    compromise(src, "config.json")
    for p_ in src.rglob("*"):
        p_.chmod(0o644)
    shutil.rmtree(tmp / "h2" / "revisions" / REV)
    p, failed = _role_run(tmp, hosts, source_vars)
    assert failed == {"h1": 0, "h2": 1}, p.stdout[-4000:]
    assert f"refused config.json from {src}" in p.stdout and "pinned on the control node" in p.stdout
    assert not (tmp / "h1" / "tiny-pd" / "evil.py").exists()
    assert json.loads(pin.read_text()) == pinned, "a pin is never rewritten by a later run"


@needs_rsync
def test_role_fanout_a_seed_with_a_changed_shard_is_refused_by_the_peer(world_readable_tmp, monkeypatch):
    """The role end to end with fan-out: the control node pins the hub's listing, the seed h1 fetches from the hub, h2
    copies from h1 with real rsync (over an `ssh` that runs the remote rsync locally). Then h1's shard is changed at
    the same size and its manifest.json rewritten to agree (h1 checks sizes only): h2 refuses it, naming h1 and the
    file, and the hub is not asked again."""
    tmp = world_readable_tmp
    hubdir = tmp / "hub"
    make_model(hubdir, revision=REV)
    srv = Server(hubdir, hub={"repo": "org/glm", "rev": REV, "api_sha": REV, "lfs": LFS})
    try:
        fake = tmp / "bin"
        fake.mkdir()
        (fake / "ssh").write_text(
            "#!/bin/sh\n"
            'while [ $# -gt 0 ]; do case "$1" in -o|-i|-p|-l) shift 2;; -*) shift;; *) break;; esac; done\n'
            'shift\nexec sh -c "$*"\n')
        (fake / "ssh").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
        hosts = {h: {"ansible_host": addr, "pd_model_root": str(tmp / h), "pd_model_path": str(tmp / h / "glm")}
                 for h, addr in (("h1", "192.0.2.11"), ("h2", "192.0.2.12"))}
        extra = {"pd_model_source": {"type": "hf", "repo_id": "org/glm", "endpoint": srv.url, "revision": REV},
                 "pd_model_peer_fanout": True, "model_weights_peer_ssh_setup": False}
        p, failed = _role_run(tmp, hosts, extra, tasks_from="fetch")
        assert failed == {"h1": 0, "h2": 0}, p.stdout[-4000:]
        pin = tmp / "control" / ".cache" / "weights" / f"org--glm@{REV}.manifest.json"
        assert "git_sha1" in {f["path"]: f for f in json.loads(pin.read_text())["files"]}["config.json"]
        assert srv.served.get(SHARD) == (hubdir / SHARD).stat().st_size, "the shard came from the hub once"
        assert (tmp / "h2" / "glm" / SHARD).read_bytes() == (hubdir / SHARD).read_bytes()

        seed_rev = tmp / "h1" / "revisions" / REV
        compromise(seed_rev, SHARD)
        for p_ in seed_rev.rglob("*"):
            p_.chmod(0o644)
        shutil.rmtree(tmp / "h2" / "revisions" / REV)
        asked = len(srv.auth_seen)
        p, failed = _role_run(tmp, hosts, dict(extra, model_weights_verify="size"), tasks_from="fetch")
        assert failed == {"h1": 0, "h2": 1}, p.stdout[-4000:]
        out = re.sub(r"\s+", " ", p.stdout)
        assert f"refused {SHARD} from host h1 (root@192.0.2.11:{seed_rev})" in out, p.stdout[-4000:]
        assert "does not match the manifest pinned on the control node" in out
        assert not (tmp / "h2" / "revisions" / REV / SHARD).exists()
        assert not (tmp / "h2" / "revisions" / REV / "evil.py").exists()
        assert len(srv.auth_seen) == asked, "pinned: the control node does not ask the hub again"
    finally:
        srv.close()


@pytest.mark.parametrize("pin", ["relative/x.manifest.json", "/srv/x.json", "/srv/x.manifest.json/"])
def test_pin_mode_refuses_a_pin_path_it_should_not_write(tmp_path, monkeypatch, pin):
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(tmp_path)}, REV, pin=pin), monkeypatch)
    assert failed and "model_weights_pin_dir" in res["msg"], res


def test_role_refuses_a_pin_name_that_is_not_a_plain_name(world_readable_tmp):
    tmp = world_readable_tmp
    hosts = {"h1": {"pd_model_root": str(tmp / "h1"), "pd_model_path": str(tmp / "h1" / "tiny-pd")}}
    p, failed = _role_run(tmp, hosts, {"pd_model_source": {"type": "path", "path": "/srv/src", "revision": REV},
                                       "model_weights_pin_name": "../../etc/x"})
    assert failed == {"h1": 1}
    assert 'model_weights_pin_name "../../etc/x" must be letters, digits, . _ -' in re.sub(r"\s+", " ", p.stdout)
    assert not (tmp / "control").exists() and not (tmp / "h1").exists()
