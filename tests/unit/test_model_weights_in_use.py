"""model_weights never prunes a revision that a vLLM instance record names (issue 15, item 3: revisions roll).

Records follow the contract of plugins/modules/vllm_instance.py (/etc/vllm/<name>.record.json and
/etc/vllm/rollback/<name>.record.json, schema 1, model_path = the revision directory the unit loads); here they
live in tmp_path and the module reads them through in_use_records. The last test serves the second revision of the
embedded default's tiny model (.cache/model-src/tiny-pd-r2, scripts/bootstrap.d/50-tiny-model) as the revision-roll
CI test will.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible.module_utils import basic
from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm
from ansible_collections.b300.pd.tests.unit.pd_testlib import ROOT
from ansible_collections.b300.pd.tests.unit.test_model_weights import args_for, make_model, run, tree

MODEL_SRC = ROOT / ".cache" / "model-src"


@pytest.fixture
def warnings(monkeypatch):
    """What the module passes to AnsibleModule.warn (run_module replaces exit_json, which would carry them)."""
    seen = []
    monkeypatch.setattr(basic.AnsibleModule, "warn", lambda self, msg: seen.append(msg))
    return seen


@pytest.fixture
def revisions(tmp_path):
    """Four sources, each its own revision (content revisions: different sizes)."""
    out = []
    for i in range(4):
        d = tmp_path / f"src{i}"
        out.append((d, make_model(d, {"model.safetensors": 200_000 + i, "config.json": 10})["revision"]))
    return out


def record(path: Path, name: str, model_path: str, model_revision: str | None):
    """An instance record as vllm_instance writes it (the fields model_weights reads, plus some it ignores)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "schema": 1, "instance": name, "pool": name.rpartition("-")[0], "unit": f"vllm-{name}.service",
        "command": ["vllm", "serve", model_path], "model_path": model_path, "model_revision": model_revision,
        "vllm_version": "0.32.0", "api_server_count": 1,
    }))
    return path


def serve(tmp_path, monkeypatch, rev, *, check=False, diff=False, **kw):
    d, r = rev
    kw.setdefault("in_use_records", [str(tmp_path / "etc-vllm" / "*.record.json"),
                                     str(tmp_path / "etc-vllm" / "rollback" / "*.record.json")])
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d), "revision": r}, r, **kw), monkeypatch,
                      check=check, diff=diff)
    assert not failed, res
    return res


def on_disk(tmp_path):
    return sorted(os.listdir(tmp_path / "root" / "revisions"))


def test_revision_named_by_a_record_is_kept_while_older_unused_ones_are_pruned(tmp_path, revisions, monkeypatch,
                                                                               warnings):
    r = [rev for _dir, rev in revisions]
    revs_dir = tmp_path / "root" / "revisions"
    etc = tmp_path / "etc-vllm"
    serve(tmp_path, monkeypatch, revisions[0])
    serve(tmp_path, monkeypatch, revisions[1])
    # prefill-0's rollback target is r0, named by model_revision; decode-0 runs r1, named only by its model_path
    # (model_revision null); an instance of another model root names nothing here.
    rollback = record(etc / "rollback" / "prefill-0.record.json", "prefill-0", str(revs_dir / r[0]), r[0])
    record(etc / "decode-0.record.json", "decode-0", str(revs_dir / r[1]), None)
    record(etc / "prefill-1.record.json", "prefill-1", "/srv/other/revisions/" + r[2], None)

    res = serve(tmp_path, monkeypatch, revisions[2])  # keep=2: r0 is beyond keep but in use
    assert res["pruned"] == [] and res["kept_in_use"] == [r[0]]
    assert res["in_use"] == {r[0]: [str(rollback)], r[1]: [str(etc / "decode-0.record.json")]}
    assert on_disk(tmp_path) == sorted(r[:3])

    # decode-0 rolled to r2: r1 is now unused and beyond keep (r3, r2), r0 still a rollback target.
    record(etc / "decode-0.record.json", "decode-0", str(revs_dir / r[2]), r[2])
    res = serve(tmp_path, monkeypatch, revisions[3])
    assert res["pruned"] == [r[1]] and res["kept_in_use"] == [r[0]]
    assert on_disk(tmp_path) == sorted([r[0], r[2], r[3]])

    # The rollback record moved on: r0 is released and pruned on the next run.
    record(etc / "rollback" / "prefill-0.record.json", "prefill-0", str(revs_dir / r[2]), r[2])
    res = serve(tmp_path, monkeypatch, revisions[3])
    assert res["pruned"] == [r[0]] and res["kept_in_use"] == [] and res["changed"] is True
    assert on_disk(tmp_path) == sorted([r[2], r[3]])
    assert json.loads((tmp_path / "root" / ".served-history.json").read_text()) == [r[3], r[2]]
    assert res["unreadable_records"] == [] and warnings == []


@pytest.mark.parametrize("case", [
    (b'{"schema": 1, "model_path": ', "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[]", "a JSON list, not an object"),
    (b'{"schema": 2, "model_path": "/srv/models/revisions/x"}', "schema 2"),
    (b'{"schema": 1, "model_revision": null}', "model_path None is not an absolute path"),
    (b'{"schema": 1, "model_path": "/srv/x", "model_revision": 7}', "model_revision 7"),
    (None, "Is a directory"),
])
def test_malformed_record_prunes_nothing_and_warns_naming_it(tmp_path, revisions, monkeypatch, warnings, case):
    content, why = case  # the record's bytes (None: a directory where the record should be), the reason reported
    serve(tmp_path, monkeypatch, revisions[0], keep=1)
    serve(tmp_path, monkeypatch, revisions[1], keep=2)
    bad = tmp_path / "etc-vllm" / "rollback" / "decode-0.record.json"
    bad.parent.mkdir(parents=True)
    if content is None:
        bad.mkdir()  # unreadable as a file
    else:
        bad.write_bytes(content)
    before = on_disk(tmp_path)
    res = serve(tmp_path, monkeypatch, revisions[2], keep=1)  # would prune r0 and r1
    assert res["pruned"] == [] and res["kept_in_use"] == []
    assert on_disk(tmp_path) == sorted([*before, revisions[2][1]])
    assert len(res["unreadable_records"]) == 1
    assert res["unreadable_records"][0].startswith(f"{bad}: ") and why in res["unreadable_records"][0]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "pruned no revision" in warnings[0]
    assert os.readlink(tmp_path / "root" / "served") == f"revisions/{revisions[2][1]}"  # the switch itself happened

    # Once the record is fixed, the next run prunes what is not in use.
    if content is None:
        bad.rmdir()
    record(bad, "decode-0", str(tmp_path / "root" / "revisions" / revisions[0][1]), revisions[0][1])
    warnings.clear()
    res = serve(tmp_path, monkeypatch, revisions[2], keep=1)
    assert res["pruned"] == [revisions[1][1]] and res["kept_in_use"] == [revisions[0][1]] and warnings == []


def test_check_mode_reports_kept_and_pruned_revisions_without_deleting(tmp_path, revisions, monkeypatch, warnings):
    r = [rev for _dir, rev in revisions]
    serve(tmp_path, monkeypatch, revisions[0])
    serve(tmp_path, monkeypatch, revisions[1])
    rec = record(tmp_path / "etc-vllm" / "prefill-0.record.json", "prefill-0",
                 str(tmp_path / "root" / "revisions" / r[0]), r[0])
    snapshot = tree(tmp_path / "root")
    res = serve(tmp_path, monkeypatch, revisions[2], keep=1, check=True, diff=True)
    assert tree(tmp_path / "root") == snapshot
    assert res["changed"] is True
    assert res["pruned"] == [r[1]] and res["kept_in_use"] == [r[0]] and res["in_use"] == {r[0]: [str(rec)]}
    assert res["diff"]["before"]["revisions"] == sorted(r[:2])
    assert res["diff"]["after"]["revisions"] == sorted([r[0], r[2]])
    assert res["diff"]["after"]["kept_in_use"] == {r[0]: [str(rec)]}
    assert "kept_in_use" not in res["diff"]["before"]

    # Nothing to fetch or switch, only a prune the record now holds back: still shown in check mode.
    res = serve(tmp_path, monkeypatch, revisions[1], keep=1, check=True, diff=True)
    assert res["pruned"] == [] and res["kept_in_use"] == [r[0]] and res["changed"] is False
    assert res["diff"]["after"]["kept_in_use"] == {r[0]: [str(rec)]}
    assert tree(tmp_path / "root") == snapshot and warnings == []


def test_relative_record_pattern_is_refused_before_anything(tmp_path, revisions, monkeypatch):
    d, r = revisions[0]
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, r, in_use_records=["etc/*.json"]),
                      monkeypatch)
    assert failed and "in_use_records ['etc/*.json'] must be absolute glob patterns" in res["msg"]
    assert not (tmp_path / "root").exists()


def _tiny(name):
    d = MODEL_SRC / name
    rev_file = MODEL_SRC / f"{name}.REVISION"
    if not (d / "manifest.json").is_file() or not rev_file.is_file():
        if os.environ.get("PD_ALLOW_NO_VLLM") == "1":
            pytest.skip(f"{d} absent and PD_ALLOW_NO_VLLM=1")
        pytest.fail(f"{d} is missing: run scripts/bootstrap --local (or set PD_ALLOW_NO_VLLM=1 to skip)")
    return d, rev_file.read_text().strip()


def test_second_tiny_revision_is_served_and_the_first_kept_while_in_use(tmp_path, monkeypatch, warnings):
    """The revision-roll test's switch: pd_model_source {type: path, path: .../tiny-pd-r2, revision: <r2>} after
    tiny-pd, with keep=1 and every instance record still naming tiny-pd's revision."""
    r1_dir, r1 = _tiny("tiny-pd")
    r2_dir, r2 = _tiny("tiny-pd-r2")
    assert mm.SHA256_RE.match(r2) and r2 != r1
    serve(tmp_path, monkeypatch, (r1_dir, r1), keep=1)
    revs_dir = tmp_path / "root" / "revisions"
    for name in ("prefill-0", "prefill-1", "decode-0"):
        record(tmp_path / "etc-vllm" / f"{name}.record.json", name, str(revs_dir / r1), r1)
    res = serve(tmp_path, monkeypatch, (r2_dir, r2), keep=1)
    assert res["revision"] == r2 and res["manifest_origin"] != "local"  # read from the source, like a fresh host
    assert res["summary"] == {"fetched": len(mm.read_manifest_file(r2_dir / "manifest.json")["files"])}
    assert os.readlink(tmp_path / "root" / "served") == f"revisions/{r2}"
    assert res["pruned"] == [] and res["kept_in_use"] == [r1] and on_disk(tmp_path) == sorted([r1, r2])
    # Same weights, tokenizer and generation config: the switch changes nothing a request can observe.
    m1 = {f["path"]: f["sha256"] for f in mm.read_manifest_file(revs_dir / r1 / "manifest.json")["files"]}
    m2 = {f["path"]: f["sha256"] for f in mm.read_manifest_file(revs_dir / r2 / "manifest.json")["files"]}
    assert set(m2) - set(m1) == {"REVISION-NOTE.txt"} and {p: m2[p] for p in m1} == m1
    assert mm.verify_files(str(revs_dir / r2), [{"path": p, "size": os.path.getsize(revs_dir / r2 / p),
                                                 "sha256": s} for p, s in m2.items()]) == dict.fromkeys(m2, mm.OK)
    assert warnings == []
