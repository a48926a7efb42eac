"""What data/ holds is trustworthy: every file carries a complete provenance block, and a GPU result names a
clean commit of this repository's history (not `-dirty`, not a commit that does not exist here)."""

import glob
import json
import os
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


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_provenance(path):
    with open(path) as f:
        d = json.load(f)
    p = d.get("provenance")
    assert isinstance(p, dict) and all(k in p for k in KEYS), f"{os.path.basename(path)}: provenance {p}"
    assert not d.get("partial"), f"{os.path.basename(path)} is a partial run"
    if os.path.basename(path) == "seeds.json":  # published figures, not a run of ours
        assert p["source"].startswith('vLLM pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region"')
        return
    commit = p["git_commit"]
    assert isinstance(commit, str) and not commit.endswith("-dirty"), f"{os.path.basename(path)}: {commit}"
    history = _history()
    if history is None:
        pytest.skip("no git history here (a copy without .git)")
    assert any(h.startswith(commit) for h in history), f"{os.path.basename(path)}: {commit} is not in the history"


def test_no_partial_files():
    assert not glob.glob(os.path.join(ROOT, "data", "*.partial.json"))
