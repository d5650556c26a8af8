"""The model weights peer copy (issue #18): the non-seed hosts' key on the seed host may only run `rrsync -ro` of the
seed's revisions directory, and the copying side accepts only the seed's pinned host key.

The role's own expressions (roles/model_weights/tasks/peer_ssh.yml, fetch.yml) are rendered with Ansible's templar;
the forced command is then run the way sshd runs it (SSH_ORIGINAL_COMMAND set, through `sh -c`) behind the module's
real rsync client, so what a peer may read, write and reach is rsync's and rrsync's real behaviour.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError
from ansible_collections.b300.pd.plugins.module_utils.model_fetchers import RsyncFetcher

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "model_weights"
SEED, PEER = "b300-01", "b300-02"


def _task(path: Path, name_start: str) -> dict:
    tasks = yaml.safe_load(path.read_text())
    return next(t for t in tasks if t["name"].startswith(name_start))


def _render(value, variables):
    templar = Templar(loader=DataLoader(), variables=variables)
    if isinstance(value, list):
        return [_render(v, variables) for v in value]
    return templar.template(trust_as_template(value)) if isinstance(value, str) else value


def _peer_facts(revisions_dir: str, known_hosts: str = "/root/.ssh/model_weights_peer_known_hosts") -> dict:
    """What peer_ssh.yml sets on a copying host (b300-02) of inventory/b300 whose seed is b300-01."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables = {
        "inventory_hostname": PEER, "ansible_host": "192.0.2.12", "ansible_all_ipv4_addresses": ["10.0.0.12"],
        "model_weights_seed_host": SEED, "model_weights_peer_rrsync": defaults["model_weights_peer_rrsync"],
        "model_weights_peer_known_hosts": known_hosts,
        "hostvars": {SEED: {"_model_weights_peer_revisions_dir": revisions_dir}},
    }
    task = _task(ROLE / "tasks" / "peer_ssh.yml", "Compute the peer-copy key's restrictions")
    variables.update({k: _render(v, variables) for k, v in task["vars"].items()})
    return {k: _render(v, variables) for k, v in task["ansible.builtin.set_fact"].items()}


def _peer_source(seed_revision_path: str, pin: list[str], ssh_setup: bool = True) -> dict:
    """The `source` fetch.yml hands the module on a copying host."""
    task = _task(ROLE / "tasks" / "fetch.yml", "Start copying, verifying and serving the revision from the seed")
    variables = {
        "model_weights_seed_host": SEED, "model_weights_peer_ssh_setup": ssh_setup,
        "model_weights_peer_ssh_args": ["-o", "ConnectTimeout=10"], "_model_weights_peer_ssh_pin": pin,
        "hostvars": {SEED: {"_model_weights_seed": {"revision_path": seed_revision_path}}},
    }
    src = task["b300.pd.model_weights"]["source"]
    return {"path": _render(src["path"], variables).strip(), "ssh_args": _render(src["ssh_args"], variables)}


def test_the_seed_authorizes_the_peer_key_for_read_only_rrsync_of_its_revisions_only():
    facts = _peer_facts("/mnt/model/glm/revisions")
    options = facts["_model_weights_peer_key_options"]
    assert options == ('restrict,from="10.0.0.12,192.0.2.12",'
                       'command="/usr/bin/rrsync -ro /mnt/model/glm/revisions"'), options
    auth = _task(ROLE / "tasks" / "peer_ssh.yml", "Authorize the peer-copy keys on the seed host")
    assert auth["ansible.posix.authorized_key"]["key_options"] == "{{ _model_weights_peer_key_options }}"
    assert auth["delegate_to"] == "{{ model_weights_seed_host }}"


def test_the_copy_uses_only_the_pinned_seed_key():
    pin = _peer_facts("/mnt/model/glm/revisions")["_model_weights_peer_ssh_pin"]
    source = _peer_source("/mnt/model/glm/revisions/" + "a" * 40, pin)
    assert source["path"] == "a" * 40, "with the restricted key the path is relative to the seed's revisions dir"
    # ssh -G prints the options ssh would use for this argv (the module's own ssh prefix + the role's args).
    fetcher = RsyncFetcher(None, source["path"], host="192.0.2.11", user="root",
                           ssh_key="/root/.ssh/model_weights_peer", ssh_args=source["ssh_args"])
    ssh = fetcher._argv([])[fetcher._argv([]).index("-e") + 1].split()
    if not shutil.which("ssh"):
        pytest.skip("no ssh client here")
    out = subprocess.run([*ssh, "-G", "192.0.2.11"], capture_output=True, text=True, check=True).stdout  # noqa: S603
    conf = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert conf["userknownhostsfile"] == "/root/.ssh/model_weights_peer_known_hosts"
    assert conf["globalknownhostsfile"] == "/dev/null"
    assert conf["hostkeyalias"] == f"model-weights-seed-{SEED}"
    # Only the pinned key's algorithm: a server offering another key type cannot be accepted as a new host.
    assert conf["hostkeyalgorithms"] == "ssh-ed25519"
    assert conf["updatehostkeys"] == "false"
    assert "StrictHostKeyChecking=yes" in source["ssh_args"]


def test_own_key_without_setup_keeps_the_seeds_absolute_path():
    source = _peer_source("/mnt/model/glm/revisions/r1", [], ssh_setup=False)
    assert source["path"] == "/mnt/model/glm/revisions/r1"
    assert source["ssh_args"] == ["-o", "ConnectTimeout=10"]


def test_the_pinned_known_hosts_holds_the_seeds_key_under_the_alias(tmp_path):
    if not shutil.which("ssh-keygen"):
        pytest.skip("no ssh-keygen here")
    key = tmp_path / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "root@seed", "-f", str(key)], check=True)  # noqa: S603, S607
    facts = _peer_facts("/mnt/model/glm/revisions")
    variables = {"ansible_managed": "managed", "model_weights_seed_host": SEED, **facts,
                 "hostvars": {SEED: {"_model_weights_seed_hostkey": {
                     "content": base64.b64encode((key.with_suffix(".pub")).read_bytes()).decode()}}}}
    text = _render((ROLE / "templates" / "peer_known_hosts.j2").read_text(), variables)
    kh = tmp_path / "known_hosts"
    kh.write_text(text)
    found = subprocess.run(["ssh-keygen", "-F", f"model-weights-seed-{SEED}", "-f", str(kh)],  # noqa: S603, S607
                           capture_output=True, text=True, check=False)
    assert found.returncode == 0, text
    assert key.with_suffix(".pub").read_text().split()[1] in found.stdout


# ------------------------------------------------------------------ the forced command, run as sshd runs it

@pytest.fixture
def seed(tmp_path, monkeypatch):
    """A seed host's model root and an `ssh` that does what sshd does with the rendered authorized_keys line."""
    if not shutil.which("rrsync") or not shutil.which("rsync"):
        pytest.skip("rsync's rrsync is not installed here (apt-get install rsync)")
    root = tmp_path / "seed" / "mnt" / "model"
    rev = root / "revisions" / "r1"
    rev.mkdir(parents=True)
    (rev / "manifest.json").write_text('{"revision": "r1", "files": []}')
    (rev / "model.safetensors").write_bytes(b"weights" * 1000)
    (root / ".staging").mkdir()
    (root / "secret").write_text("not for peers")
    options = _peer_facts(str(root / "revisions"))["_model_weights_peer_key_options"]
    forced = options.split('command="', 1)[1].rstrip('"')
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(
        "#!/bin/sh\n"
        "# sshd with a forced command: the client's command only reaches it as SSH_ORIGINAL_COMMAND\n"
        'while [ $# -gt 0 ]; do case "$1" in -o|-i|-p|-l) shift 2;; -*) shift;; *) break;; esac; done\n'
        "shift\n"
        f'SSH_ORIGINAL_COMMAND="$*" exec sh -c {forced!r}\n'
    )
    (fake / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{Path(shutil.which('rsync')).parent}:/usr/bin:/bin")
    return root


def _run(argv):
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
    return proc.returncode, proc.stdout, proc.stderr


def test_a_peer_reads_the_revision_through_rrsync(seed, tmp_path):
    source = _peer_source(str(seed / "revisions" / "r1"), [])
    fetcher = RsyncFetcher(_run, source["path"], host="192.0.2.11", user="root", ssh_args=source["ssh_args"])
    assert fetcher.manifest(str(tmp_path))["revision"] == "r1"
    part = tmp_path / "model.safetensors.part"
    fetcher.fetch({"path": "model.safetensors", "size": 7000}, str(part))
    assert part.read_bytes() == b"weights" * 1000


def test_the_old_absolute_path_does_not_pass_rrsync(seed, tmp_path):
    """Why fetch.yml sends a relative path: rrsync reads a leading / as the root of its restricted dir."""
    fetcher = RsyncFetcher(_run, str(seed / "revisions" / "r1"), host="192.0.2.11", user="root")
    with pytest.raises(ManifestError):
        fetcher.manifest(str(tmp_path))


@pytest.mark.parametrize("remote", ["../secret", "/../secret", "../.staging", "/etc/passwd"])
def test_a_peer_cannot_read_outside_the_revisions(seed, tmp_path, remote):
    rc, _out, err = _run(["rsync", "-e", "ssh", "--", f"root@seed:{remote}", str(tmp_path / "got")])
    assert rc != 0, err
    assert not (tmp_path / "got").exists()


def test_a_peer_cannot_write_or_delete(seed, tmp_path):
    (tmp_path / "evil").write_text("planted")
    rc, _out, err = _run(["rsync", "-e", "ssh", "--", str(tmp_path / "evil"), "root@seed:r1/evil"])
    assert rc != 0 and "read-only" in err, err
    assert not (seed / "revisions" / "r1" / "evil").exists()
    rc, _out, err = _run(["rsync", "-r", "--delete", "-e", "ssh", "--", f"{tmp_path}/empty/", "root@seed:r1/"])
    assert rc != 0
    assert (seed / "revisions" / "r1" / "model.safetensors").exists()


def test_a_peer_gets_no_shell(seed):
    rc, out, err = _run(["ssh", "root@seed", "cat", str(seed / "secret")])
    assert rc != 0 and "not for peers" not in out, (out, err)


# ------------------------------------------------------------------ the seed does not decide what the others run

def test_a_changed_file_on_the_seed_is_refused_by_every_other_host_through_rrsync(seed, tmp_path, monkeypatch):
    """Issue #32: the seed's copy of config.json is changed (and its manifest.json rewritten to agree, with code
    added); every other host copies over the real rrsync path and refuses it, naming the seed host and the file,
    because it checks against the manifest pinned on the control node, never the seed's."""
    from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm
    from ansible_collections.b300.pd.tests.unit.pd_testlib import load_library, run_module

    rev = "ab" * 20  # a hub commit: its file list cannot vouch for itself
    revdir = seed / "revisions" / rev
    revdir.mkdir()
    (revdir / "config.json").write_text('{"architectures": ["GlmForCausalLM"]}')
    (revdir / "model.safetensors").write_bytes(b"weights" * 1000)
    pinned = mm.build_manifest(revdir, revision=rev)  # what the control node pinned (from the hub's listing)
    (revdir / "manifest.json").write_text(mm.dumps_manifest(pinned))
    (revdir / "config.json").write_text('{"auto_map": {"AutoModel": "evil.AutoModel"}}')
    (revdir / "evil.py").write_text("import os\n")
    (revdir / "manifest.json").write_text(mm.dumps_manifest(mm.build_manifest(revdir, revision=rev)))

    source = _peer_source(str(revdir), [])
    module = load_library("model_weights")
    for host in ("b300-02", "b300-03"):
        root = tmp_path / host
        args = {"root": str(root), "link": str(root / "served"), "revision": rev, "manifest": pinned,
                "buffer_size_mib": 1, "space_margin_mib": 0,
                "source": {"type": "peer", "name": SEED, "host": "192.0.2.11", "user": "root",
                           "path": source["path"], "ssh_args": source["ssh_args"]}}
        res, failed = run_module(module.main, args, monkeypatch=monkeypatch)
        assert failed, res
        assert f"refused config.json from host {SEED} (root@192.0.2.11:{rev})" in res["msg"], res["msg"]
        assert "does not match the manifest pinned on the control node" in res["msg"], res["msg"]
        assert not (root / "revisions" / rev / "config.json").exists()
        assert not (root / "revisions" / rev / "evil.py").exists()
        assert (root / "revisions" / rev / "model.safetensors").read_bytes() == b"weights" * 1000
        assert not (root / "served").exists()
