"""bench/ci_stage_times.py: the times of a CI log, from scripts/bootstrap's and scripts/test's own lines."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.b300.pd.bench import ci_stage_times as cst

ROOT = Path(__file__).resolve().parents[2]

CONCURRENT = """\
=== bootstrap: 10-control-venv
=== bootstrap: 40-wheelhouse
noise from a stage: === bootstrap: 99-fake done in 7 s
=== bootstrap: 40-wheelhouse done in 28 s
=== bootstrap: 10-control-venv done in 27 s
=== bootstrap: 45-vllm-venv done in 85 s
=== bootstrap: all 3 stages done in 113 s
=== stage lint
=== stage lint: passed in 120 s
=== stage unit: FAILED after 200 s
"""

ONE_BY_ONE = """\
=== bootstrap: 10-control-venv done in 27 s
=== bootstrap: 40-wheelhouse done in 28 s
=== stage lint: passed in 121 s
"""


def test_concurrent_bootstrap_wall_time_is_its_own_line_not_the_sum():
    rows = cst.parse(CONCURRENT)
    assert rows == {"bootstrap/40-wheelhouse": 28, "bootstrap/10-control-venv": 27, "bootstrap/45-vllm-venv": 85,
                    "bootstrap": 113, "stage/lint": 120, "stage/unit": 200, "total": 113 + 120 + 200}
    assert list(rows)[-4:] == ["bootstrap", "stage/lint", "stage/unit", "total"]


def test_one_by_one_bootstrap_wall_time_is_the_sum():
    assert cst.parse(ONE_BY_ONE) == {"bootstrap/10-control-venv": 27, "bootstrap/40-wheelhouse": 28,
                                     "bootstrap": 55, "stage/lint": 121, "total": 176}


def test_table_gives_the_difference_to_the_first_log(tmp_path, capsys):
    (tmp_path / "old.log").write_text(ONE_BY_ONE)
    (tmp_path / "new.log").write_text(CONCURRENT)
    assert cst.main([str(tmp_path / "old.log"), str(tmp_path / "new.log")]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["bootstrap"] == ["55", "113", "+58"]
    assert lines["stage/lint"] == ["121", "120", "-1"]
    assert lines["stage/unit"] == ["-", "200", "-"]
    assert lines["total"] == ["176", "433", "+257"]


BACKGROUND = """\
=== bootstrap: all 3 stages done in 113 s
=== stage molecule: started in the background beside lint unit (output: reports/ci/molecule-stage.out)
=== stage lint: passed in 70 s
=== stage unit: passed in 400 s
=== stage molecule (ran in the background)
=== stage molecule: passed in 221 s (in the background; the run waited 0 s for it)
=== stage full: passed in 2000 s
"""


def test_a_background_stage_adds_only_the_time_the_run_waited_for_it():
    rows = cst.parse(BACKGROUND)
    assert rows["stage/molecule"] == 221 and rows["stage/molecule:waited"] == 0
    assert rows["total"] == 113 + 70 + 400 + 0 + 2000


def test_no_log_prints_usage(capsys):
    assert cst.main([]) == 2
    assert "ci.log" in capsys.readouterr().err
