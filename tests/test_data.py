"""What data/ holds is trustworthy and accounted for: every file carries a complete provenance block, every GPU
result names the same clean commit of this repository's history, and the manifest (data/README.md) lists every
file, the command that writes it and the files that read it, each of which does read it."""

import glob
import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "data", "*.json")))
KEYS = ("device", "date", "git_commit", "command")


def _history() -> set[str] | None:
    try:
        out = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.stdout.split()) if out.returncode == 0 and out.stdout else None


def _manifest() -> tuple[dict, dict]:
    """({file: (command, [readers])}, {partial file: what did not run}) from data/README.md's two tables."""
    files, partial = {}, {}
    with open(os.path.join(ROOT, "data", "README.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = re.fullmatch(r"`([^`]+\.json)`", cells[0]) if line.startswith("|") else None
            if name and len(cells) == 3:
                files[name.group(1)] = (cells[1], re.findall(r"`([^`]+)`", cells[2]))
            elif name and len(cells) == 2:
                partial[name.group(1)] = cells[1]
    return files, partial


def _load(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_provenance(path):
    d = _load(path)
    p = d.get("provenance")
    assert isinstance(p, dict) and all(k in p for k in KEYS), f"{os.path.basename(path)}: provenance {p}"
    assert not d.get("partial") or os.path.basename(path) in _manifest()[1], f"{path}: partial, not said so"
    if os.path.basename(path) == "seeds.json":  # published figures, not a run of ours
        assert p["source"].startswith('vLLM pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region"')
        return
    commit = p["git_commit"]
    assert isinstance(commit, str) and not commit.endswith("-dirty"), f"{os.path.basename(path)}: {commit}"
    history = _history()
    if history is None:
        pytest.skip("no git history here (a copy without .git)")
    assert any(h.startswith(commit) for h in history), f"{os.path.basename(path)}: {commit} is not in the history"


def test_every_result_is_at_one_commit():
    commits = {_load(f)["provenance"]["git_commit"][:12] for f in FILES if not f.endswith("seeds.json")}
    assert len(commits) == 1, commits


def test_the_manifest_lists_every_file_and_who_reads_it():
    files, partial = _manifest()
    assert sorted(files) == sorted(os.path.basename(f) for f in FILES)
    assert set(partial) <= set(files) and all(partial.values())
    for name, (command, readers) in files.items():
        assert command and readers, name
        if command.startswith("`python -m dsv32ref"):
            assert command.split()[3].strip("`") in _load(os.path.join(ROOT, "data", name))["provenance"]["command"]
        for reader in readers:
            with open(os.path.join(ROOT, reader)) as f:
                text = f.read()
            fstring = re.escape(name)  # or named through an f-string over the model: ttft_{model}.json
            for model in ("glm-5.2", "deepseek-v3.2"):
                fstring = fstring.replace(re.escape(model), r"\{[^}]*\}")
            assert name in text or re.search(fstring, text), (name, reader)


def test_no_partial_files():
    assert not glob.glob(os.path.join(ROOT, "data", "*.partial.json"))


def test_every_data_file_named_in_the_repository_exists():
    """A docstring, notebook or README that cites a file in data/ cites one that is there (not one re-recorded away)."""
    missing = []
    for top in ("dsv32ref", "notebooks", "scripts", "tests"):
        for path in glob.glob(os.path.join(ROOT, top, "**", "*.*"), recursive=True):
            if not path.endswith((".py", ".md", ".ipynb")) or ".ipynb_checkpoints" in path:
                continue
            with open(path) as f:
                for name in set(re.findall(r"data/([A-Za-z0-9_.-]+\.json)", f.read())):
                    if "{" not in name and not os.path.exists(os.path.join(ROOT, "data", name)):
                        missing.append((os.path.relpath(path, ROOT), name))
    with open(os.path.join(ROOT, "README.md")) as f:
        missing += [("README.md", n) for n in re.findall(r"data/([A-Za-z0-9_.-]+\.json)", f.read())
                    if not os.path.exists(os.path.join(ROOT, "data", n))]
    assert not missing, missing


def test_the_main_jobs_full_run_records_every_file_by_its_command():
    """`python -m dsv32ref --record` (reproduce's full plan) writes each file data/README.md lists with a
    `python -m dsv32ref` command, by that command (a ledger's --measured names the run it models)."""
    from dsv32ref.experiments.reproduce import PRESETS

    files, _ = _manifest()
    recorded = {name: command.split("`")[1].split()[3:] for name, (command, _) in files.items()
                if command.startswith("`python -m dsv32ref")}
    plan = {name: [a for a in args if not a.startswith("{dir}") and a != "--measured"]
            for name, args in PRESETS["full"].commands}
    assert plan == recorded
