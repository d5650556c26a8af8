"""plugins/modules/pd_instance_state.py: what an instance runs now comes from the records vllm_instance wrote (the saved
previous state while a restart is pending), never from the unit text (issue #15)."""

from __future__ import annotations

import json

from ansible_collections.b300.pd.tests.unit.pd_testlib import load_library, run_module

state = load_library("pd_instance_state")


def _record(rev, key):
    return {"schema": 1, "instance": "prefill-0", "python": "/opt/vllm/venvs/v2/bin/python",
            "venv": "/opt/vllm/venvs/v2", "vllm_version": "0.32.0", "nixl_version": "0.7.1", "compat_key": key,
            "model_revision": rev, "model_path": f"/srv/models/revisions/{rev}"}


def test_current_record_then_the_saved_one_while_a_restart_is_pending(tmp_path, monkeypatch):
    (tmp_path / "prefill-0.record.json").write_text(json.dumps(_record("r2", "k2")))
    res, failed = run_module(state.main, {"instances": ["prefill-0"], "env_dir": str(tmp_path)},
                             monkeypatch=monkeypatch)
    assert not failed and not res["changed"]
    got = res["instances"]["prefill-0"]
    assert (got["key"], got["revision"], got["source"], got["restart_pending"]) == ("k2", "r2", "current", False)
    assert got["vllm"] == "0.32.0" and got["venv"] == "/opt/vllm/venvs/v2"

    # vllm_instance wrote r2 but the process was not restarted yet: it still runs what rollback/ holds
    (tmp_path / ".prefill-0.restart-pending").write_text("pending\n")
    (tmp_path / "rollback").mkdir()
    (tmp_path / "rollback" / "prefill-0.record.json").write_text(json.dumps(_record("r1", "k1")))
    res, _failed = run_module(state.main, {"instances": ["prefill-0"], "env_dir": str(tmp_path)},
                              monkeypatch=monkeypatch)
    got = res["instances"]["prefill-0"]
    assert (got["key"], got["revision"], got["source"], got["restart_pending"]) == ("k1", "r1", "rollback", True)


def test_no_or_damaged_record_is_unknown_not_a_traceback(tmp_path, monkeypatch):
    (tmp_path / "decode-0.record.json").write_text("{not json")
    res, failed = run_module(state.main, {"instances": ["prefill-0", "decode-0"], "env_dir": str(tmp_path)},
                             monkeypatch=monkeypatch)
    assert not failed
    for name in ("prefill-0", "decode-0"):
        assert res["instances"][name]["key"] == "unknown" and res["instances"][name]["source"] == "none"
