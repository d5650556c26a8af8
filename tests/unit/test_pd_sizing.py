"""The P:D sizing model and tool (issue 34) on synthetic pool figures where the right answer is known."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from ansible_collections.b300.pd.bench import pd_sizing
from ansible_collections.b300.pd.bench import pd_sizing_model as model

# A synthetic cluster: one prefill instance serves P tokens/s of prompt, one decode instance D tokens/s of output
# (at the SLA), both falling with the context length as attention grows.
PREFILL_TPS = {16384: 40000.0, 131072: 20000.0}
DECODE_TPS = {16384: 6000.0, 131072: 3000.0}
OUT = 1024


def true_rate(n_p, n_d, n_in, n_out=OUT):
    return min(n_p * PREFILL_TPS[n_in] / n_in, n_d * DECODE_TPS[n_in] / n_out)


def measured(shapes, n_in, bound=True):
    out = []
    for n_p, n_d in shapes:
        rate = true_rate(n_p, n_d, n_in)
        which = "prefill" if n_p * PREFILL_TPS[n_in] / n_in <= n_d * DECODE_TPS[n_in] / OUT else "decode"
        out.append({"name": f"{n_p}P{n_d}D", "prefill": n_p, "decode": n_d, "max_rate": rate,
                    **({"bound": which} if bound else {})})
    return out


B300 = {
    "shared_hardware": False,
    "classes": [{"input_tokens": n, "output_tokens": OUT, "measurements": measured([(4, 1), (1, 1)], n)}
                for n in (16384, 131072)],
    "instance_types": {"prefill": {"gpus": 4, "tp_size": 1, "dp_size": 4},
                       "decode": {"gpus": 8, "tp_size": 1, "dp_size": 8}},
    "cluster": {"gpus": 24, "gpus_per_host": 8, "hosts": ["b300-01", "b300-02", "b300-03"]},
}


def test_fit_recovers_the_per_instance_rates_and_predicts_an_unmeasured_shape():
    fit = model.fit(measured([(4, 1), (1, 1)], 16384))
    assert fit["terms"]["prefill"]["exact"] and fit["terms"]["decode"]["exact"]
    assert fit["terms"]["prefill"]["value"] == pytest.approx(40000 / 16384)
    assert fit["terms"]["decode"]["value"] == pytest.approx(6000 / OUT)
    for shape in ((2, 2), (3, 1), (1, 3)):
        assert model.predict(fit, *shape)["max_rate"] == pytest.approx(true_rate(*shape, 16384))


def test_a_pool_no_measurement_was_bound_by_is_only_a_lower_bound():
    fit = model.fit(measured([(1, 1), (1, 2)], 16384))  # prefill bound in both: decode never seen binding
    assert not fit["terms"]["decode"]["exact"]
    pred = model.predict(fit, 8, 1)
    assert pred["bound"] == "decode" and pred["lower_bound_only"]


def test_shared_budget_binds_when_the_measurements_say_so():
    ms = [{"prefill": 1, "decode": 1, "max_rate": 8.0, "bound": "shared"},
          {"prefill": 2, "decode": 1, "max_rate": 8.5, "bound": "shared"}]
    fit = model.fit(ms, shared=True)
    assert model.predict(fit, 2, 2)["max_rate"] == pytest.approx(math.sqrt(8 * 8.5))
    with pytest.raises(model.SizingError, match=r"measurements\[0\]\.bound: 'shared' needs shared hardware"):
        model.fit(ms, shared=False)


def test_inconsistent_bounds_are_refused_naming_the_field():
    # 1P1D decode bound at 4 req/s means d = 4; 2P1D prefill bound at 2 means p = 1: then 1P1D would be prefill
    # bound at 1 req/s, not 4.
    ms = [{"prefill": 1, "decode": 1, "max_rate": 4.0, "bound": "decode"},
          {"prefill": 2, "decode": 1, "max_rate": 2.0, "bound": "prefill"}]
    with pytest.raises(model.SizingError, match="no reading of the bounds fits"):
        model.fit(ms)
    # Both prefill bound but not scaling: a fit, with its error said (log rms of the misfit).
    ms[0]["bound"] = "prefill"
    assert model.fit(ms)["error"] == pytest.approx(math.log(2))


def _split(mix, **extra):
    return pd_sizing.split(dict(B300, mix=mix, **extra))


def test_prefill_bound_mix_gets_the_prefill_heavy_split():
    # Long prompts, short answers: prefill work dominates -> as many prefill instances as fit beside one decode.
    answer = _split([{"input_tokens": 131072, "output_tokens": 600, "weight": 1}])
    chosen = answer["chosen"]
    assert (chosen["prefill"], chosen["decode"]) == (4, 1)
    best = max(answer["candidates"], key=lambda c: c["max_rate"])
    assert chosen["max_rate"] == best["max_rate"]
    assert chosen["bound"] == "prefill"


def test_decode_bound_mix_gets_the_decode_heavy_split():
    # Short prompts, long answers: decode work dominates -> a second decode instance beats more prefill.
    answer = _split([{"input_tokens": 16384, "output_tokens": 2048, "weight": 1}])
    chosen = answer["chosen"]
    assert (chosen["prefill"], chosen["decode"]) == (2, 2)
    assert chosen["max_rate"] == pytest.approx(min(2 * 40000 / 16384, 2 * 6000 / 2048))


def test_target_rate_takes_the_fewest_gpus_with_headroom():
    answer = _split([{"input_tokens": 16384, "output_tokens": 1024, "weight": 1}], target_rate=4.0, headroom=0.2)
    chosen = answer["chosen"]
    # 2P1D: prefill 4.88, decode 5.86 req/s >= 4.8: the fewest GPUs (16) that serve 4 req/s with 20 % headroom.
    assert (chosen["prefill"], chosen["decode"], chosen["gpus"]) == (2, 1, 16)
    assert all(v >= 0.2 for v in chosen["headroom"].values())
    with pytest.raises(model.SizingError, match="target_rate: 100 req/s"):
        _split([{"input_tokens": 16384, "output_tokens": 1024, "weight": 1}], target_rate=100.0)


def test_mix_outside_the_measured_range_is_refused():
    with pytest.raises(model.SizingError, match=r"mix\[0\]\.input_tokens: 262144 is outside the measured"):
        _split([{"input_tokens": 262144, "output_tokens": 1024, "weight": 1}])
    with pytest.raises(model.SizingError, match=r"mix\[1\]\.output_tokens: 8192 is not within 2x"):
        _split([{"input_tokens": 16384, "output_tokens": 1024}, {"input_tokens": 16384, "output_tokens": 8192}])


def test_mixed_classes_interpolate_between_measured_lengths():
    rates = model.class_rates(pd_sizing.fitted_classes(B300), [{"input_tokens": 65536, "output_tokens": 1024}])
    # prefill tokens/s halfway in log L between 40000 and 20000 -> 40000 * 2**(-2/3)
    assert rates[0]["p"] * 65536 == pytest.approx(40000 * 2 ** (-2 / 3))


def test_patch_places_every_instance_on_disjoint_gpus_of_the_hosts():
    answer = _split([{"input_tokens": 16384, "output_tokens": 2048, "weight": 1}])
    patch = answer["patch"]
    pools = [i["pool"] for hv in patch.values() for i in hv["pd_instances"]]
    assert pools.count("prefill") == 2 and pools.count("decode") == 2
    for hv in patch.values():
        gpus = [g for i in hv["pd_instances"] for g in i["gpus"]]
        assert len(gpus) == len(set(gpus)) and max(gpus) < 8
        ports = [i["http_port"] for i in hv["pd_instances"]]
        assert len(ports) == len(set(ports))


def test_split_is_refused_on_shared_hardware():
    with pytest.raises(model.SizingError, match="shared_hardware"):
        pd_sizing.split(dict(B300, shared_hardware=True, mix=[{"input_tokens": 16384, "output_tokens": 1024}]))


def test_bound_of_reads_the_failing_metric_and_the_host_load():
    ctx = {"max_rate": 8.0, "points": [
        {"rate": 8.0, "passed": True, "load_avg_1m": 1.2},
        {"rate": 16.0, "passed": False, "reason": "mean TPOT 26.5 ms > 20"},
        {"rate": 11.0, "passed": False, "reason": "mean TTFT 2900 ms > 2500"}]}
    assert pd_sizing.bound_of(ctx, shared_hardware=False, cores=2) == "prefill"  # the lowest failing rate: TTFT
    ctx["points"][0]["load_avg_1m"] = 7.6
    assert pd_sizing.bound_of(ctx, shared_hardware=True, cores=2) == "shared"


def test_cli_predict_and_split(tmp_path, capsys):
    src = tmp_path / "in.yml"
    src.write_text(yaml.safe_dump(dict(B300, mix=[{"input_tokens": 16384, "output_tokens": 2048, "weight": 1}])))
    assert pd_sizing.main(["predict", "--input", str(src), "--shape", "2P2D", "--measured-rate", "5"]) == 0
    out = capsys.readouterr().out
    assert "2P2D at 16384/1024 tokens" in out and "error" in out
    assert pd_sizing.main(["split", "--input", str(src), "--patch-dir", str(tmp_path / "hv")]) == 0
    assert "split: 2 prefill x 4 GPUs + 2 decode x 8 GPUs" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "hv").iterdir())
    assert pd_sizing.main(["predict", "--input", str(src), "--shape", "2x2"]) == 2
    assert "--shape: '2x2'" in capsys.readouterr().err
    json.dumps(pd_sizing.predict(yaml.safe_load(src.read_text()), "3P1D"))  # serializable
