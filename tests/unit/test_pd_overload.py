"""bench/pd_overload.py: the criteria of issue #31's overload test (a pass case and each way to fail), the capacity
report's max rate, bad input, and a short real run of two keys against a local stub front door."""

from __future__ import annotations

import json

import pytest
from ansible_collections.b300.pd.bench import pd_overload
from ansible_collections.b300.pd.bench.pd_load_generator import latency_stats
from ansible_collections.b300.pd.tests.unit.test_pd_load import FakeServer

SLA = {"ttft_mean_s": 2.5, "tpot_mean_ms": 20.0}
RUN_SLA = {"ttft_mean_s": 2.5, "tpot_mean_ms": 100.0}  # the stub paces its tokens 30 ms apart


def _rep(rate, sent, completed, failures=None, *, ttft=0.5, tpot=0.01, shed_s=0.01, no_ra=0, send_s=10.0):
    failures = failures or {}
    return {"config": {"rate": rate}, "sent": sent, "completed": completed, "failed": sum(failures.values()),
            "failures": failures, "send_duration_s": send_s, "retry_after_missing": no_ra,
            "failure_latency_s": {cls: latency_stats([shed_s if cls == "http_429" else 1.0] * n)
                                  for cls, n in failures.items()},
            "ttft_s": latency_stats([ttft] * completed), "tpot_s": latency_stats([tpot] * completed),
            "prompt_tokens": latency_stats([3000] * completed), "error_samples": {}}


def _good(**heavy):
    """max rate 10: heavy 27 req/s sheds 200 of 270, light 3 req/s all admitted; goodput 10 req/s."""
    h = {"rate": 27, "sent": 270, "completed": 70, "failures": {"http_429": 200}, **heavy}
    return {"heavy": _rep(**h), "light": _rep(3, 30, 30)}


def _failed(rep):
    return {c["name"] for c in rep["criteria"] if not c["passed"]}


def test_all_criteria_pass():
    rep = pd_overload.evaluate(_good(), 10.0, SLA)
    assert rep["passed"] is True and _failed(rep) == set()
    o = rep["overall"]
    assert (o["sent"], o["completed"], o["shed"], o["goodput_req_s"]) == (300, 100, 200, 10.0)
    assert o["admitted_ttft_mean_s"] == 0.5 and o["admitted_tpot_mean_ms"] == 10.0
    assert rep["keys"]["heavy"]["admitted_fraction"] == round(70 / 270, 4)
    assert rep["keys"]["light"]["admitted_fraction"] == 1.0 and rep["keys"]["heavy"]["shed_latency_p99_s"] == 0.01
    assert [c["name"] for c in rep["criteria"]] == ["sent", "admitted_ttft_mean", "admitted_tpot_mean",
                                                    "admitted_failures", "light_admitted", "shed_retry_after",
                                                    "shed_latency_p99", "no_5xx", "goodput"]


@pytest.mark.parametrize(("change", "fails"), [
    ({"ttft": 3.0}, "admitted_ttft_mean"),
    ({"tpot": 0.025}, "admitted_tpot_mean"),
    ({"no_ra": 1}, "shed_retry_after"),
    ({"shed_s": 0.2}, "shed_latency_p99"),
    ({"completed": 69, "failures": {"http_429": 200, "http_503": 1}}, "no_5xx"),
    ({"completed": 69, "failures": {"http_429": 200, "timeout": 1}}, "admitted_failures"),
    ({"completed": 40, "failures": {"http_429": 230}}, "goodput"),
])
def test_each_criterion_can_fail(change, fails):
    reports = _good(**change)
    if "ttft" in change or "tpot" in change:  # the pooled mean over both keys: move the light key's too
        reports["light"] = _rep(3, 30, 30, **{k: v for k, v in change.items() if k in ("ttft", "tpot")})
    rep = pd_overload.evaluate(reports, 10.0, SLA)
    assert rep["passed"] is False and _failed(rep) == {fails}


def test_light_key_share_and_nothing_sent():
    reports = _good()
    reports["light"] = _rep(3, 30, 28, {"http_429": 2})  # 93.3 % admitted
    rep = pd_overload.evaluate(reports, 10.0, SLA)
    assert _failed(rep) == {"light_admitted"} and rep["keys"]["light"]["admitted_fraction"] == 0.9333
    reports["light"] = _rep(3, 0, 0)
    assert {"sent", "light_admitted"} <= _failed(pd_overload.evaluate(reports, 10.0, SLA))
    # nothing completed: no TTFT/TPOT figure is a failure, not a pass
    none = {"heavy": _rep(27, 10, 0, {"http_429": 10}), "light": _rep(3, 3, 0, {"http_429": 3})}
    assert {"admitted_ttft_mean", "admitted_tpot_mean", "goodput"} <= _failed(pd_overload.evaluate(none, 1, SLA))


def test_factors_and_capacity_report(tmp_path):
    assert pd_overload.parse_factors("light=0.5, heavy=3") == {"heavy": 3.0, "light": 0.5}
    for bad in ("heavy=2.7", "heavy=x,light=1", "heavy=2.7;light=0.3", "heavy=0,light=1", "a=1,b=2"):
        with pytest.raises(pd_overload.UsageError, match="--load-factors"):
            pd_overload.parse_factors(bad)
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"mode": "search", "contexts": [
        {"context": 256, "max_rate": 20.0}, {"context": 1024, "max_rate": 8.0},
        {"context": 3072, "max_rate": 3.5}, {"context": 4000, "max_rate": 0.0}]}))
    assert pd_overload.max_rate_from_report(str(path), 3000) == (3.5, 3072)
    assert pd_overload.max_rate_from_report(str(path), 900) == (8.0, 1024)
    path.write_text(json.dumps({"contexts": [{"context": 3072, "max_rate": 0.0}]}))
    with pytest.raises(pd_overload.UsageError, match="no context length with a max_rate > 0"):
        pd_overload.max_rate_from_report(str(path), 3000)
    with pytest.raises(pd_overload.UsageError, match="not a readable report.json"):
        pd_overload.max_rate_from_report(str(tmp_path / "absent.json"), 3000)


def test_cli_bad_input_exits_2(capsys, tmp_path):
    assert pd_overload.main(["--load-factors", "heavy=1"]) == 2
    assert "--max-rate or --capacity-report" in capsys.readouterr().err
    assert pd_overload.main(["--max-rate", "4", "--load-factors", "heavy=1"]) == 2
    assert "--load-factors" in capsys.readouterr().err
    assert pd_overload.main(["--capacity-report", str(tmp_path / "nope.json")]) == 2
    assert "--capacity-report" in capsys.readouterr().err
    assert pd_overload.main(["--max-rate", "-1"]) == 2
    assert "--max-rate" in capsys.readouterr().err


def _front_door(heavy_action, light_action=("stream", "paced")):
    """A stub front door: key 'k1' (heavy) gets heavy_action(k), key 'k2' (light) light_action."""
    def plan(k, req):
        if req["headers"].get("Authorization") == "Bearer k1":
            return heavy_action(k)
        if req["headers"].get("Authorization") == "Bearer k2":
            return light_action
        return ("status", 401)
    return FakeServer(plan)


def _run(srv, **kw):
    return pd_overload.run_overload(None, 4.0, "heavy=5,light=1", 1.0, 8, 4, 5.0, url=srv.url, model="m",
                                    sla=RUN_SLA, api_keys={"heavy": "k1", "light": "k2"}, **kw)


def test_run_against_a_stub_front_door_passes():
    srv = _front_door(lambda k: ("shed", "1") if k % 2 else ("stream", "paced"))
    try:
        rep = _run(srv)
    finally:
        srv.close()
    assert rep["passed"] is True, rep["criteria"]
    h, li = rep["keys"]["heavy"], rep["keys"]["light"]
    assert rep["rates"] == {"heavy": 20.0, "light": 4.0}
    assert (h["sent"], li["sent"]) == (20, 4) and li["admitted_fraction"] == 1.0 and li["shed"] == 0
    assert 5 <= h["shed"] <= 15 and h["completed"] == 20 - h["shed"]
    # streamed: TTFT, TPOT (30 ms a token) and the prompt tokens (5 + 8 words) measured
    assert 25 <= rep["overall"]["admitted_tpot_mean_ms"] <= 200 and rep["overall"]["admitted_ttft_mean_s"] < 1
    assert li["prompt_tokens"]["mean"] == 13 and h["shed_latency_p99_s"] < 1.0
    assert all(r["body"]["stream"] is True for r in srv.requests)
    # the load generator's own CPU over the run (this process): measured, a fraction of a core for 24 requests
    cpu = rep["client_cpu"]
    assert cpu["wall_s"] >= 1.0 and 0 < cpu["cpu_s"] and 0 < cpu["cores"] < 2, cpu


def test_run_against_a_stub_front_door_fails(monkeypatch, tmp_path, capsys):
    """429 without Retry-After and a 503: both criteria fail, main() exits 1 and writes the report."""
    def heavy(k):
        return {0: ("shed", None), 1: ("status", 503)}.get(k % 4, ("stream", "paced"))

    srv = _front_door(heavy)
    try:
        targets = {"url": srv.url, "model": "m", "sla": RUN_SLA}
        monkeypatch.setattr(pd_overload, "inventory_targets", lambda inv: targets)
        monkeypatch.setenv("PD_LOAD_API_KEY", "k1")
        monkeypatch.setenv("PD_LOAD_API_KEY_2", "k2")
        out = tmp_path / "o" / "overload.json"
        rc = pd_overload.main(["--max-rate", "4", "--load-factors", "heavy=5,light=1", "--duration", "1",
                               "--prompt-words", "8", "--max-tokens", "4", "--timeout", "5", "--out", str(out)])
    finally:
        srv.close()
    assert rc == 1
    rep = json.loads(out.read_text())
    assert rep["passed"] is False and _failed(rep) == {"shed_retry_after", "no_5xx"}
    assert rep["overall"]["http_5xx"] >= 1 and rep["overall"]["shed_without_retry_after"] >= 1
    text = capsys.readouterr().out
    assert "FAIL shed_retry_after" in text and "FAIL no_5xx" in text and text.rstrip().endswith(str(out))


def test_same_key_twice_is_refused():
    with pytest.raises(pd_overload.UsageError, match="same key"):
        pd_overload.run_overload(None, 4.0, "heavy=1,light=1", 1.0, 8, 4, 5.0, url="http://127.0.0.1:1",
                                 model="m", sla=SLA, api_keys={"heavy": "k", "light": "k"})
