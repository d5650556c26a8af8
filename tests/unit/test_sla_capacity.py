"""bench/sla_capacity.py: the capacity search (bracket + bisect), vllm bench serve result parsing, SLA verdict,
the inventory's context range, Prometheus answers.

The search runs on synthetic monotone latency curves whose knee is known exactly; the parser reads a result
file that `vllm bench serve --save-result` wrote against the live local stack (tests/fixtures/capacity).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "sla_capacity.py"
FIXTURE = ROOT / "tests" / "fixtures" / "capacity" / "vllm_bench_serve_result.json"
_spec = importlib.util.spec_from_file_location("sla_capacity", SCRIPT)
cap = importlib.util.module_from_spec(_spec)
sys.modules["sla_capacity"] = cap  # dataclasses resolve their module by name
_spec.loader.exec_module(cap)

SLA = cap.Sla(ttft_mean_ms=2500.0, tpot_mean_ms=20.0)


# ------------------------------------------------------------------------------------------ search
def _queue_ttft_ms(rate: float, capacity: float) -> float:
    """M/M/1-like mean TTFT: 200 ms service, blowing up as the rate nears the capacity (monotone)."""
    return math.inf if rate >= capacity else 200.0 / (1.0 - rate / capacity)


def _knee(capacity: float, limit_ms: float) -> float:
    # 200 / (1 - r/c) = limit  <=>  r = c (1 - 200/limit)
    return capacity * (1.0 - 200.0 / limit_ms)


@pytest.mark.parametrize("capacity", [0.037, 0.4, 1.3, 2.7, 9.0, 55.0])
@pytest.mark.parametrize("precision", [0.05, 0.1, 0.2])
def test_search_finds_knee_to_precision_with_few_points(capacity, precision):
    knee = _knee(capacity, SLA.ttft_mean_ms)
    calls = []

    def measure(rate):
        calls.append(rate)
        return _queue_ttft_ms(rate, capacity) <= SLA.ttft_mean_ms

    found, fail, points = cap.capacity_search(measure, start_rate=0.5, precision=precision, min_rate=0.01,
                                              max_points=20)
    assert found <= knee  # the reported rate passed: never above the true knee
    assert fail > knee  # the bracket's failing end really fails
    assert fail / found - 1.0 <= precision + 1e-12
    assert (knee - found) / knee <= precision  # within the precision of the knee
    # doubling/halving to the bracket, then log2(ln 2 / ln(1+p)) bisections: bounded, not a sweep
    bracket = abs(math.log2(knee / 0.5)) + 2
    assert len(points) <= bracket + math.ceil(math.log2(math.log(2) / math.log1p(precision))) + 1
    assert [r for r, _ in points] == calls


def test_search_stops_at_max_points():
    found, _, points = cap.capacity_search(lambda r: r < 1000.0, 0.5, 0.01, 0.01, max_points=5)
    assert len(points) == 5
    assert found == 8.0  # 0.5 1 2 4 8 all pass; no failing rate found within the budget


def test_search_reports_zero_when_even_min_rate_fails():
    found, fail, points = cap.capacity_search(lambda r: False, 0.5, 0.1, 0.05, max_points=20)
    assert found == 0.0
    assert fail == pytest.approx(0.0625)  # 0.5 0.25 0.125 0.0625; 0.03125 < min_rate is not measured
    assert len(points) == 4


def test_search_rejects_bad_parameters():
    with pytest.raises(cap.UsageError, match="precision"):
        cap.capacity_search(lambda r: True, 0.5, 0.0, 0.01, 8)


def test_sweep_knee_is_last_pass_before_first_fail():
    assert cap.knee_of_sweep([(0.6, True), (0.2, True), (0.4, True), (0.8, False), (1.0, True)]) == 0.6
    assert cap.knee_of_sweep([(0.2, False), (0.4, True)]) == 0.0
    assert cap.sweep_rates(0.6, 1.4, 9) == [0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4]


# ------------------------------------------------------------------------------------------ vllm bench result
def test_parse_real_vllm_bench_result():
    data = json.loads(FIXTURE.read_text())
    point = cap.parse_bench_result(data, cap.Point(context=256, rate=0.5, num_prompts=data["num_prompts"]))
    assert point.completed == 6
    assert point.failed == 0
    assert point.mean_ttft_ms == pytest.approx(335.1396503333793)
    assert point.mean_tpot_ms == pytest.approx(2.792291715048768)
    assert point.p99_ttft_ms == pytest.approx(1152.780893800082)
    assert point.request_goodput == pytest.approx(0.4762853889441355)
    assert point.duration_s == pytest.approx(12.59748910900089)
    assert cap.sla_verdict(point, SLA) == (True, "meets SLA")


def test_parse_counts_missing_requests_as_failed_without_failed_field():
    data = json.loads(FIXTURE.read_text())
    del data["failed"]
    data["completed"] = 4
    point = cap.parse_bench_result(data, cap.Point(context=256, rate=0.5, num_prompts=6))
    assert point.failed == 2
    ok, reason = cap.sla_verdict(point, SLA)
    assert not ok
    assert "4/6 completed" in reason


def test_parse_all_failed_has_no_latency():
    data = dict(json.loads(FIXTURE.read_text()), completed=0, failed=6, mean_ttft_ms=0.0, mean_tpot_ms=0.0)
    point = cap.parse_bench_result(data, cap.Point(context=256, rate=0.5, num_prompts=6))
    assert point.mean_ttft_ms is None  # vLLM's 0.0 would plot as the best point (and as -inf on a log axis)
    assert cap.sla_verdict(point, SLA) == (False, "6 failed, 0/6 completed")


def test_parse_rejects_other_json():
    with pytest.raises(ValueError, match="mean_ttft_ms"):
        cap.parse_bench_result({"completed": 1, "duration": 1.0, "mean_tpot_ms": 1.0},
                               cap.Point(context=1, rate=1.0, num_prompts=1))


# ------------------------------------------------------------------------------------------ SLA verdict
@pytest.mark.parametrize(("ttft", "tpot", "ok", "text"), [
    (2500.0, 20.0, True, "meets SLA"),  # at the limit meets it (<=)
    (2500.1, 5.0, False, "mean TTFT 2500 ms > 2500"),
    (100.0, 20.5, False, "mean TPOT 20.5 ms > 20"),
    (3000.0, 30.0, False, "mean TTFT 3000 ms > 2500; mean TPOT 30.0 ms > 20"),
])
def test_sla_verdict(ttft, tpot, ok, text):
    p = cap.Point(context=1, rate=1.0, num_prompts=4, completed=4, mean_ttft_ms=ttft, mean_tpot_ms=tpot)
    assert cap.sla_verdict(p, SLA) == (ok, text)


def test_sla_verdict_fails_on_a_failed_request_even_if_fast():
    p = cap.Point(context=1, rate=1.0, num_prompts=4, completed=3, failed=1, mean_ttft_ms=1.0, mean_tpot_ms=1.0)
    assert cap.sla_verdict(p, SLA)[0] is False


# ------------------------------------------------------------------------------------------ inventory
def _vars(inv):
    return cap._load_group_vars(ROOT / "inventory" / inv)


def test_b300_contexts_are_the_recipe_range():
    plan = cap.plan_from_vars(_vars("b300"))
    assert plan.sla == cap.Sla(2500.0, 20.0)
    # 256K clipped to the window minus the output tokens, as verify does
    assert cap.context_lengths(plan.context_min, plan.context_max, 4, plan.max_model_len, plan.output_len) == [
        16384, 65536, 131072, 262144 - plan.output_len]


def test_local_contexts_come_from_its_own_range():
    plan = cap.plan_from_vars(_vars("local"))
    assert plan.model == "tiny-pd"
    assert cap.context_lengths(plan.context_min, plan.context_max, 2, plan.max_model_len, plan.output_len) == [
        plan.context_min, plan.context_max]


def test_bad_inventory_names_the_field():
    v = dict(_vars("local"))
    v["pd_sla"] = dict(v["pd_sla"], tpot_mean_ms="fast")
    with pytest.raises(cap.UsageError, match=r"pd_sla\.tpot_mean_ms"):
        cap.plan_from_vars(v)
    with pytest.raises(cap.UsageError, match="pd_verify_sla_output_len"):
        cap.plan_from_vars({k: val for k, val in _vars("local").items() if k != "pd_verify_sla_output_len"})


def test_prompts_bounded():
    assert cap.prompts_for(0.1, 20, 6, 200) == 6
    assert cap.prompts_for(1.3, 20, 6, 200) == 26
    assert cap.prompts_for(50, 20, 6, 200) == 200


# ------------------------------------------------------------------------------------------ Prometheus
def test_prom_vector_drops_nan_and_keeps_pools():
    payload = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pool": "decode"}, "value": [1, "0.25"]},
        {"metric": {"pool": "prefill"}, "value": [1, "NaN"]}]}}
    assert cap.parse_prom_vector(payload) == {"decode": 0.25}
    with pytest.raises(ValueError, match="bad_data"):
        cap.parse_prom_vector({"status": "error", "error": "bad_data"})
    assert cap.prom_window(12.4, 15) == "43s"


def test_main_bad_inventory_exits_2(tmp_path, capsys):
    rc = cap.main(["--inventory", str(tmp_path), "--base-url", "http://127.0.0.1:1", "--tokenizer", "x"])
    assert rc == 2
    assert "--inventory" in capsys.readouterr().err
