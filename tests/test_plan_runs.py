"""Recorded `bench plan` runs read as one (minidist/bench/_plan_runs.py): each layout's median over
the runs, and the median of the runs' correlations, computed here by hand."""
import json

import pytest

from minidist.bench import plan as bench_plan
from minidist.bench._plan_runs import load_run, median_of_runs, spearman


def record(name, predicted, measured, bubble=None):
    return {"kind": "layout", "layout": name, "predicted_step_seconds": predicted, "measured_step_seconds": measured,
            "bubble": bubble}


def write_run(path, records, extra=()):
    path.write_text(json.dumps([{"kind": "calibration", "alpha": 2e-5}, *records, *extra,
                                {"kind": "summary", "spearman": 0.0, "layouts_run": len(records)}]))
    return str(path)


# three runs of four layouts; "pp2" has a bubble; "late" is missing from the third run
RUNS = [
    [record("dp4", 0.010, 0.011), record("tp4", 0.020, 0.030), record("pp2", 0.030, 0.024, {"measured": 0.20, "predicted": 0.15, "theory": 0.1}),
     record("zero3", 0.040, 0.041), record("late", 0.05, 0.05)],
    [record("dp4", 0.012, 0.012), record("tp4", 0.020, 0.022), record("pp2", 0.030, 0.036, {"measured": 0.16, "predicted": 0.15, "theory": 0.1}),
     record("zero3", 0.040, 0.020), record("late", 0.05, 0.05)],
    [record("dp4", 0.010, 0.009), record("tp4", 0.022, 0.033), record("pp2", 0.033, 0.033, {"measured": 0.18, "predicted": 0.16, "theory": 0.1}),
     record("zero3", 0.040, 0.044)],
]


@pytest.fixture
def paths(tmp_path):
    return [write_run(tmp_path / f"run{i}.json", records) for i, records in enumerate(RUNS)]


def test_each_layout_takes_its_median_ratio(paths):
    summary = median_of_runs([load_run(p) for p in paths])
    rows = {row["layout"]: row for row in summary["layouts"]}
    assert list(rows) == ["dp4", "tp4", "pp2", "zero3"]  # by median predicted time; "late" is not in every run
    assert summary["left_out"] == ["late"]
    assert rows["tp4"]["ratios"] == pytest.approx([1.5, 1.1, 1.5]) and rows["tp4"]["ratio"] == pytest.approx(1.5)
    assert rows["zero3"]["ratio"] == pytest.approx(1.025)  # 1.025, 0.5, 1.1: one bad run is outvoted
    assert rows["pp2"]["ratio"] == pytest.approx(1.0) and rows["dp4"]["ratio"] == pytest.approx(1.0)
    assert rows["pp2"]["bubble"] == pytest.approx({"measured": 0.18, "predicted": 0.15, "theory": 0.1})
    assert "bubble" not in rows["dp4"]
    assert rows["tp4"]["measured_step_seconds"] == pytest.approx(0.030)
    # tp4 is outside 25 % in runs 1 and 3, zero3 in run 2: each run and the medians have 3 of 4 within
    assert summary["within_25_percent_each"] == [3, 3, 3] and summary["within_25_percent"] == 3


def test_the_correlation_is_the_median_of_the_runs(paths):
    summary = median_of_runs([load_run(p) for p in paths])
    # predicted ranks 1, 2, 3, 4 in runs 1 and 2, measured ranks (1, 3, 2, 4) and (1, 3, 4, 2): without
    # ties rho = 1 - 6 sum(d^2) / (n (n^2 - 1)) = 1 - 6*2/60 = 0.8 and 1 - 6*6/60 = 0.4
    each = [spearman([0.010, 0.020, 0.030, 0.040], [0.011, 0.030, 0.024, 0.041]),
            spearman([0.012, 0.020, 0.030, 0.040], [0.012, 0.022, 0.036, 0.020]),
            spearman([0.010, 0.022, 0.033, 0.040], [0.009, 0.033, 0.033, 0.044])]
    assert each[0] == pytest.approx(0.8) and each[1] == pytest.approx(0.4)
    assert summary["spearman_each"] == pytest.approx(each)
    assert summary["spearman"] == pytest.approx(sorted(each)[1])
    # the median times: predicted (0.010, 0.020, 0.030, 0.040), measured (0.011, 0.030, 0.033, 0.041)
    assert summary["spearman_of_medians"] == pytest.approx(1.0)


def test_bad_input_fails_in_one_line(tmp_path, paths, capsys):
    with pytest.raises(ValueError, match="at least 2 runs"):
        median_of_runs([load_run(paths[0])])
    calibration_only = tmp_path / "calibration.json"
    calibration_only.write_text(json.dumps([{"kind": "calibration"}]))
    with pytest.raises(ValueError, match="no layout records"):
        load_run(str(calibration_only))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(ValueError, match="not readable as JSON"):
        load_run(str(broken))
    zero = write_run(tmp_path / "zero.json", [record("dp4", 0.0, 0.01), record("tp4", 0.02, 0.02)])
    with pytest.raises(ValueError, match="lacks a positive"):
        load_run(zero)
    other = write_run(tmp_path / "other.json", [record("pp4", 0.01, 0.01), record("tp2", 0.02, 0.02)])
    with pytest.raises(ValueError, match="share 0 layout"):
        median_of_runs([load_run(paths[0]), load_run(other)])
    with pytest.raises(SystemExit):  # through the command line: one line, before any measurement
        bench_plan.main(["--median-of", paths[0]])
    assert "--median-of: a median needs at least 2 runs" in capsys.readouterr().err


def test_command_line_prints_and_writes_the_medians(tmp_path, paths, capsys):
    out = tmp_path / "median.json"
    assert bench_plan.main(["--median-of", *paths, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tp4" in text and "outside 25 %" in text and "the median ratio within 25 % on 3 of 4" in text
    written = json.loads(out.read_text())
    assert [e["layout"] for e in written if e["kind"] == "median_layout"] == ["dp4", "tp4", "pp2", "zero3"]
    assert written[-1]["kind"] == "median_summary" and written[-1]["within_25_percent"] == 3


def test_a_layouts_bubble_is_the_median_of_its_passes_not_the_fastest_passs():
    """bench plan keeps a layout's fastest pass for the step time, but that pass is the one whose
    stages ran most evenly: its bubble is the lowest. The bubble reported is the passes' median."""
    from minidist.core.model import GPTConfig
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    layout = {"dp": 1, "tp": 1, "pp": 2, "microbatches": 8, "schedule": "1f1b"}
    row = {"name": "pp2-m8", "layout": layout, "step_seconds": 0.08, "bubble_fraction": 0.152,
           "bytes_sent": {"tp": 0, "pp": 1, "embedding": 0, "dp": 0},
           **{k: 0.0 for k in ("compute", "bubble", "tp", "pp", "dp", "gradients", "machinery", "sharing")}}
    fastest = {"step_seconds": [0.09, 0.075], "memory": [],
               "pipeline": {"bubble_measured": 0.131, "bubble_theory": 1 / 9}}
    workload = bench_plan.demo_workload(config, 16)
    got = bench_plan.compare(row, fastest, workload, bubbles=[0.171, 0.131, None, 0.158])["bubble"]
    assert got["measured"] == pytest.approx(0.158)       # of 0.131, 0.158, 0.171; a pass without one left out
    assert got["measured_fastest_pass"] == 0.131
    assert got["measured_each_pass"] == [0.171, 0.131, None, 0.158]
    assert got["predicted"] == 0.152 and got["theory"] == pytest.approx(1 / 9)
    # one pass: its own bubble
    assert bench_plan.compare(row, fastest, workload)["bubble"]["measured"] == 0.131
    assert bench_plan.typical_bubble([None]) is None


@pytest.mark.full  # two passes of one layout under mpiexec, and the yardsticks three times: about a minute
@pytest.mark.timeout(300)
def test_bench_plan_runs_a_pipeline_and_reports_each_passs_bubble(tmp_path):
    """`bench plan` end to end on 2 ranks, one layout: its jobs run under real mpiexec, the memory
    ledger is equal to the byte, and the bubble recorded is the median of the passes' bubbles, each
    between the formula's 1/3 (GPipe, m = 2, the stages a little unequal) and 0.45."""
    import os
    import subprocess
    import sys
    out = tmp_path / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    job = subprocess.run([sys.executable, "-m", "minidist.bench", "plan", "--ranks", "2", "--match", "pp2-m2-gpipe",
                          "--repeats", "2", "--steps", "3", "--json", str(out)], env=env, timeout=280,
                         capture_output=True, text=True)
    assert job.returncode == 0, job.stderr[-2000:]
    records = json.loads(out.read_text())
    (layout,) = [r for r in records if r["kind"] == "layout"]
    assert layout["layout"] == "pp2-m2-gpipe" and all(m["states_equal"] for m in layout["memory"])
    bubble = layout["bubble"]
    each = bubble["measured_each_pass"]
    assert len(each) == 2 and all(1 / 3 - 0.01 < b < 0.45 for b in each), bubble
    assert bubble["measured"] == pytest.approx(sum(each) / 2)
    assert bubble["measured_fastest_pass"] in each and bubble["theory"] == pytest.approx(1 / 3)
    assert records[-1]["kind"] == "summary" and records[-1]["layouts_run"] == 1
