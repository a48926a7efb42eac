from dsv32ref.__main__ import main


def test_main_job_runs_and_passes_its_checks(capsys):
    assert main(["summary", "--preset", "tiny-glm-5.2"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2        total 671.878B, softmax scale 0.135234" in out
    assert "glm-5.2              total 743.377B" in out and "21/78 layers run their indexer" in out
    assert "FAIL" not in out and "all checks passed" in out


def test_reproduce_on_a_cpu_prints_the_recorded_table_beside_the_pr(capsys):
    """Without a GPU, `dsv32ref reproduce` says so and prints the PR's figures beside the recorded run's."""
    import json

    import torch

    from dsv32ref.experiments.reproduce import table

    if torch.cuda.is_available():
        return  # on a GPU the command runs the reproduction itself (the device runs record it)
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
