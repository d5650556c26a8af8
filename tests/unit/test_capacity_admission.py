"""bench/capacity_admission.py: the front door's admission limit from a capacity report (Little's law at the highest
rate of each context within a margin of the SLA, the fewest over the contexts, per front door), and the inventory
patch it writes."""

from __future__ import annotations

import pytest
import yaml
from ansible_collections.b300.pd.bench.capacity_admission import admission_limit, inflight_within_sla, inventory_patch


def _ctx(context, max_rate, points, fail_rate=99.0):
    return {"context": context, "max_rate": max_rate, "fail_rate": fail_rate, "points": [
        {"rate": r, "passed": ok, "request_throughput": thr, "mean_ttft_ms": ttft, "mean_tpot_ms": tpot}
        for r, ok, thr, ttft, tpot in points]}


SLA = {"ttft_mean_ms": 2500.0, "tpot_mean_ms": 20.0}
REPORT = {"output_len": 33, "sla": SLA, "contexts": [
    # 256 tokens: 60 req/s met at 0.2 s TTFT + 32 x 5 ms = 0.36 s -> 21.6 in flight (a miss at 80 is ignored)
    _ctx(256, 60.0, [(60.0, True, 60.0, 200.0, 5.0), (80.0, False, 70.0, 3000.0, 30.0)]),
    # 3072 tokens: two passing repeats at 10 req/s: 10 x (1.0 + 0.16) = 11.6 and 9.5 x (1.2 + 0.16) = 12.92
    _ctx(3072, 10.0, [(10.0, True, 10.0, 1000.0, 5.0), (10.0, True, 9.5, 1200.0, 5.0),
                      (5.0, True, 5.0, 100.0, 5.0)]),
]}


def test_inflight_is_rate_times_latency_at_the_knee():
    assert inflight_within_sla(REPORT["contexts"][0], 33, SLA) == pytest.approx(60 * 0.36)
    assert inflight_within_sla(REPORT["contexts"][1], 33, SLA) == pytest.approx((11.6 + 12.92) / 2)
    assert inflight_within_sla(_ctx(3072, 0.0, [(1.0, False, 1.0, 9000.0, 5.0)]), 33, SLA) is None


def test_limit_is_the_fewest_over_contexts_per_front_door():
    one = admission_limit(REPORT)
    assert one["max_inflight"] == 12 and one["by_context"] == {256: 21.6, 3072: 12.26}
    assert one["max_rate"] == 10.0 and one["binding_context"] == 3072
    two = admission_limit(REPORT, front_doors=2)
    assert two["max_inflight"] == 6 and two["max_rate"] == 5.0
    assert admission_limit({"output_len": 33, "sla": SLA, "contexts": [_ctx(256, 0.0, [])]})["max_inflight"] == 0
    with pytest.raises(ValueError, match="front_doors"):
        admission_limit(REPORT, front_doors=0)


def test_patch_is_a_group_vars_file_naming_its_source():
    text = inventory_patch(admission_limit(REPORT), "reports/capacity/x/report.json")
    assert yaml.safe_load(text) == {"pd_frontdoor_max_inflight": 12, "pd_frontdoor_max_rate": 10.0}
    assert "reports/capacity/x/report.json" in text and "3072 tokens: 12.26" in text


def test_a_context_without_a_bracket_is_left_out_while_another_has_one():
    # 256 tokens never failed (a lower bound: 1.2 in flight at 4 req/s); 3072 bracketed its knee (12.26)
    rep = {"output_len": 33, "sla": SLA,
           "contexts": [_ctx(256, 4.0, [(4.0, True, 4.0, 100.0, 5.0)], fail_rate=None), REPORT["contexts"][1]]}
    lim = admission_limit(rep)
    assert lim["max_inflight"] == 12 and lim["used"] == [3072]
    assert "(no bracket, left out)" in inventory_patch(lim, "r.json")
    only = admission_limit({"output_len": 33, "sla": SLA, "contexts": [rep["contexts"][0]]})
    assert only["max_inflight"] == 1 and only["used"] == [256]  # nothing better known: the lower bound


def test_the_limit_is_taken_where_the_sla_holds_with_a_margin_not_at_the_knee():
    # The embedded default's search of 2026-12-07 (3072 tokens, 32 output tokens): the knee (14.67 req/s, TPOT
    # 19.4 ms, 17 in flight) held the door at a TPOT of 21-23.5 ms under overload; 13.45 req/s (TTFT 318 ms, TPOT
    # 15.3 ms: within 0.8 x pd_sla) gives 10.5 in flight, which met it.
    ctx = _ctx(3072, 14.67, [(8.0, True, 7.95, 260.0, 8.5), (16.0, False, 15.9, 1032.0, 33.3),
                             (11.31, True, 11.21, 250.0, 9.6), (13.45, True, 13.32, 318.0, 15.3),
                             (14.67, True, 14.44, 579.0, 19.4)])
    lim = admission_limit({"output_len": 32, "sla": SLA, "contexts": [ctx]})
    assert lim["by_context"] == {3072: 10.55} and lim["max_inflight"] == 10
    assert lim["max_rate"] == 14.67  # a key's share stays a part of the capacity
    assert admission_limit({"output_len": 32, "sla": SLA, "contexts": [ctx]}, margin=1.0)["max_inflight"] == 17
    assert inflight_within_sla(ctx, 32, SLA, margin=1.0) == pytest.approx(14.44 * (579.0 + 31 * 19.4) / 1000)
    # No passing point within the margin: no limit (the patch says none met it), never the knee's.
    tight = _ctx(3072, 14.67, [(14.67, True, 14.44, 579.0, 19.4), (16.0, False, 15.9, 1032.0, 33.3)])
    assert admission_limit({"output_len": 32, "sla": SLA, "contexts": [tight]})["max_inflight"] == 0
    with pytest.raises(ValueError, match="margin"):
        admission_limit(REPORT, margin=0)
    with pytest.raises(ValueError, match="sla"):
        admission_limit({"output_len": 32, "contexts": []})
    assert "within 0.8 x pd_sla" in admission_limit(REPORT)["rule"]
    assert "meets 0.8 x pd_sla" in inventory_patch(admission_limit(REPORT), "r.json")
