"""The command line: the main job's summary, the reproduction's table (the PR, the recorded run, this machine),
where runs write, and every subcommand answering on a machine without a GPU."""

import json
import os

import pytest
import torch

from dsv32ref import __main__ as cli
from dsv32ref.__main__ import main
from dsv32ref.experiments import reproduce
from dsv32ref.results import DATA_DIR, run_dir

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the commands run the experiments themselves")


def test_main_job_runs_and_passes_its_checks(capsys):
    assert main(["summary", "--preset", "tiny-glm-5.2"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2        total 671.878B, softmax scale 0.135234" in out
    assert "glm-5.2              total 743.377B" in out and "21/78 layers run their indexer" in out
    assert "FAIL" not in out and "all checks passed" in out
    recorded = out[out.index("Recorded in data/"):out.index("all checks passed")].strip().splitlines()
    assert len(recorded) <= 4, recorded  # what data/ holds, in a few lines


@pytest.mark.parametrize("argv", [["--seed", "7", "summary"], ["summary", "--seed", "7"],
                                  ["--preset", "tiny-glm-5.2", "--quick", "--record", "reproduce"],
                                  ["reproduce", "--quick", "--record"], ["--quick", "kernels"], ["--record", "ttft"]])
def test_options_before_the_command_are_kept(argv):
    """--preset, --seed, --quick and --record given before the command or after it: the value given (a command's
    parser had set its own defaults over the ones given before it: `--seed 7 summary` ran seed 0)."""
    args = cli._parse(argv)
    got = {k: getattr(args, k) for k in ("seed", "preset", "quick", "record")}
    assert got == {"seed": 7 if "--seed" in argv else 0, "preset": ["tiny-glm-5.2"] if "--preset" in argv else None,
                   "quick": "--quick" in argv, "record": "--record" in argv}, argv


def test_presets_on_both_sides_of_summary_are_all_run():
    """--preset before summary and after it: both (the one after had replaced the one before)."""
    args = cli._parse(["--preset", "tiny-glm-5.2", "summary", "--preset", "tiny-deepseek-v3.2"])
    assert args.preset == ["tiny-glm-5.2", "tiny-deepseek-v3.2"]
    assert not hasattr(args, "preset_after")


@pytest.mark.parametrize("argv", [["--seed", "7", "ledger"], ["--quick", "fp8-accuracy"], ["--record", "summary"],
                                  ["--preset", "tiny-glm-5.2", "ttft"]])
def test_options_before_a_command_that_does_not_take_them_are_refused(argv, capsys):
    """A top-level option the command never reads: refused, not ignored."""
    assert main(argv) == 2
    assert f"dsv32ref: error: {argv[0]}: {argv[-1]} does not take it" in capsys.readouterr().err


@CPU
@pytest.mark.parametrize("argv", [["--quick"], ["--record", "--preset", "tiny-glm-5.2"]])
def test_reproduces_options_without_a_command_need_a_gpu(argv, capsys):
    """--quick or --record with no command on a CPU: refused before the summary runs (they were ignored, exit 0)."""
    assert main(argv) == 2
    assert "dsv32ref: error: --quick and --record are reproduce's, which needs a CUDA GPU" in capsys.readouterr().err


@CPU
@pytest.mark.parametrize("cmd", ["reproduce", "ttft", "capture", "regimes", "timeline", "hostcosts", "kernels",
                                 "fp8-speed"])
def test_gpu_subcommands_say_what_they_need_on_a_cpu(cmd, capsys):
    assert main([cmd]) == 2
    out = capsys.readouterr()
    assert "CUDA GPU" in out.out + out.err


@CPU
def test_reproduce_on_a_cpu_prints_the_recorded_table_beside_the_pr(capsys):
    """Without a GPU, `dsv32ref reproduce` says so and prints the PR's figures beside the recorded run's."""
    assert main(["reproduce"]) == 2
    out = capsys.readouterr().out
    assert "PR" in out and "recorded" in out and "this machine" in out
    rows = {r["what"]: r for r in reproduce.table()}
    seeds = json.load(open("data/seeds.json"))
    run = json.load(open("data/ttft_glm-5.2.json"))
    r = rows["wide TTFT mean (ms)"]
    assert r["pr"] == seeds["ttft"]["wide"]["mean_ms"] and r["recorded"] == run["variants"]["wide"]["mean_ms"]
    assert r["live"] is None and rows["direct launches removed by narrowing"]["pr"] == 333
    assert rows["none TTFT mean (ms)"]["pr"] is None and rows["narrow_copy start-up, estimate on"]["recorded"]


def test_reproduce_runs_each_command_in_a_process_of_its_own(monkeypatch, tmp_path, capsys):
    """The wiring of the main job on a GPU: each preset's commands, each with its output in the run's folder;
    then the table reads that folder beside data/ (here a stand-in run that copies data/'s files)."""
    calls = []

    def fake(args):  # a stand-in run: data/'s file, wide's mean TTFT one millisecond slower
        calls.append(args)
        out = args[args.index("--out") + 1]
        assert os.path.dirname(out) == str(tmp_path)
        d = json.load(open(os.path.join("data", os.path.basename(out))))
        if os.path.basename(out).startswith("ttft_"):
            d["variants"]["wide"]["mean_ms"] += 1.0
        json.dump(d, open(out, "w"))

    monkeypatch.setattr(reproduce, "run_command", fake)
    rows = {r["what"]: r for r in reproduce.run("quick", str(tmp_path))}
    assert [c[0] for c in calls] == ["ttft", "capture"]
    assert calls[0][calls[0].index("--requests") + 1] == "64" and "quick" in calls[1]
    assert rows["wide TTFT mean (ms)"]["live"] == rows["wide TTFT mean (ms)"]["recorded"] + 1.0  # read from the run
    assert all(r["live"] == r["recorded"] for w, r in rows.items() if "wide" not in w)
    assert "this machine" in capsys.readouterr().out
    calls.clear()
    reproduce.run("full", str(tmp_path))
    assert [c[0] for c in calls] == ["ttft", "ttft", "capture", "capture", "regimes", "timeline", "kernels",
                                     "fp8-speed", "fp8-accuracy", "ledger", "ledger"]
    assert "--instrument-ab" in calls[0] and "--instrument-ab" not in calls[1]
    assert calls[-1][calls[-1].index("--measured") + 1] == os.path.join(str(tmp_path), "ttft_deepseek-v3.2.json")
    with pytest.raises(ValueError, match="preset must be one of"):
        reproduce.run("medium", str(tmp_path))


def test_the_main_job_on_a_gpu_reproduces_into_a_run_folder(monkeypatch, capsys):
    """`python -m dsv32ref --quick` on a GPU: the summary, then the quick reproduction into runs/<UTC time>/
    (data/ only with --record)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(reproduce, "run", lambda preset, out_dir: calls.append((preset, out_dir)))
    assert main(["--quick", "--preset", "tiny-glm-5.2"]) == 0
    assert calls[0][0] == "quick" and calls[0][1].startswith(os.path.join("runs", "20"))
    assert main(["--record", "--preset", "tiny-glm-5.2"]) == 0 and calls[1] == ("full", DATA_DIR)
    assert "all checks passed" in capsys.readouterr().out


def test_runs_write_to_a_folder_of_their_own_unless_asked_to_record(monkeypatch, tmp_path):
    """A live run never writes into data/ unless --record: the predicted ledger of a two-layer structure."""
    from dsv32ref.experiments import ledger

    base = ledger.structure_config("glm-5.2").replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                      first_k_dense_replace=1)
    monkeypatch.setattr(ledger, "structure_config", lambda preset: base)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "DATA_DIR", str(tmp_path / "data"))  # the repository's data/ (no measured run in it)
    assert run_dir().startswith(os.path.join("runs", "20")) and run_dir().endswith("Z")
    assert main(["ledger", "--predict"]) == 0
    (written,) = list((tmp_path / "runs").rglob("ledger_predicted_glm-5.2.json"))
    assert json.loads(written.read_text())["variants"]["narrow"]["graph_launches"] == 3
    assert not (tmp_path / "data").exists()
    assert main(["ledger", "--predict", "--record"]) == 0
    assert (tmp_path / "data" / "ledger_predicted_glm-5.2.json").exists()


def test_ttft_hands_every_arm_flag_to_its_protocol(monkeypatch, tmp_path):
    """`dsv32ref ttft` with each arm flag: the protocol the run gets holds each flag's boundaries (a GPU assumed, the
    run itself replaced)."""
    from dsv32ref.experiments import ttft

    got = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ttft, "run", lambda p, out: got.append((p, out)))
    out = str(tmp_path / "t.json")
    assert main(["ttft", "--skip-topk", "none", "--fp8-kv", "narrow", "--fused-moe", "wide", "--skinny-gemm",
                 "narrow_out", "--fused-skinny", "none", "narrow", "--instrument-ab", "--out", out]) == 0
    p, where = got[0]
    assert (p.skip_topk, p.fp8_kv, p.fused_moe, p.skinny_gemm, p.fused_skinny) == (
        ("none",), ("narrow",), ("wide",), ("narrow_out",), ("none", "narrow"))
    assert p.instrument_ab == ("wide", "narrow", "narrow_out") and where == out
    assert [name for name, _, _ in p.arms()][-2:] == ["none+fused+skinny", "narrow+fused+skinny"]
