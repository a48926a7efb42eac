from dsv32ref.__main__ import main


def test_main_job_runs_and_passes_its_checks(capsys):
    assert main(["summary", "--preset", "tiny-glm-5.2"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2        total 671.878B, softmax scale 0.135234" in out
    assert "glm-5.2              total 743.377B" in out and "21/78 layers run their indexer" in out
    assert "FAIL" not in out and "all checks passed" in out
