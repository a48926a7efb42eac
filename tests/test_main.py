import pytest
import torch

from dsv32ref.__main__ import main


def test_main_job_runs_and_passes_its_checks(capsys):
    assert main(["summary", "--preset", "tiny-glm-5.2"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2        total 671.878B, softmax scale 0.135234" in out
    assert "glm-5.2              total 743.377B" in out and "21/78 layers run their indexer" in out
    assert "FAIL" not in out and "all checks passed" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the command runs the reproduction itself")
def test_reproduce_on_a_cpu_prints_the_recorded_table_beside_the_pr(capsys):
    """Without a GPU, `dsv32ref reproduce` says so and prints the PR's figures beside the recorded run's."""
    import json

    from dsv32ref.experiments.reproduce import table

    assert main(["reproduce"]) == 2
    out = capsys.readouterr().out
    assert "reproduce needs a CUDA GPU" in out and "PR (TP4)" in out
    rows = {r["what"]: r for r in table()}
    seeds = json.load(open("data/seeds.json"))
    run = json.load(open("data/ttft_glm-5.2.json"))
    r = rows["wide TTFT mean (ms)"]
    assert r["pr"] == seeds["ttft"]["wide"]["mean_ms"] and r["ours"] == run["variants"]["wide"]["mean_ms"]
    assert abs(r["ratio"] - r["ours"] / r["pr"]) < 1e-12
    assert rows["direct launches removed by narrowing"]["pr"] == 333
    assert rows["none TTFT mean (ms)"]["pr"] is None


def test_reproduce_runs_each_experiment_of_its_preset(monkeypatch, tmp_path, capsys):
    """The wiring of `dsv32ref reproduce` (the GPU runs themselves are recorded in data/): which experiments
    each preset runs, with which arguments and outputs, then the table from what they wrote."""
    import shutil

    from dsv32ref.experiments import capture_memory, regimes, reproduce, ttft

    calls = []
    for name in ("seeds.json", "ttft_glm-5.2.json", "capture_memory_glm-5.2_h16.json"):
        shutil.copy(f"data/{name}", tmp_path / name)
    monkeypatch.setattr(ttft, "run", lambda model, **kw: calls.append(("ttft", model, kw)))
    monkeypatch.setattr(capture_memory, "run_plan", lambda model, **kw: calls.append(("capture", model, kw)))
    monkeypatch.setattr(capture_memory, "run", lambda model, runs, **kw: calls.append(("capture", model,
                                                                                      {**kw, "runs": runs})))
    monkeypatch.setattr(regimes, "run", lambda model, **kw: calls.append(("regimes", model, kw)))
    rows = reproduce.run("quick", data_dir=str(tmp_path))
    assert [c[:2] for c in calls] == [("ttft", "glm-5.2"), ("capture", "glm-5.2")]
    assert calls[0][2]["n_requests"] == 64 and calls[1][2]["heads_per_rank"] == 16
    assert calls[1][2]["runs"] == reproduce.QUICK_CAPTURE and rows and "PR (TP4)" in capsys.readouterr().out
    assert calls[1][2]["out"].endswith("capture_memory_glm-5.2_h16_quick.json")
    calls.clear()
    reproduce.run("full", data_dir=str(tmp_path))
    assert [c[:2] for c in calls] == [("ttft", "glm-5.2"), ("ttft", "deepseek-v3.2"), ("capture", "glm-5.2"),
                                      ("regimes", "glm-5.2")]
    assert calls[0][2]["n_requests"] == 256 and calls[0][2]["instrument_ab"] and calls[0][2]["skip_topk"]
    with pytest.raises(ValueError, match="preset must be one of"):
        reproduce.run("medium")
