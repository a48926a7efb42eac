"""The provenance block every file under data/ carries: where, with what, when, from which commit, how."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

import torch


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _command() -> str:
    """The command line as a user would type it: `python -m pkg.mod args` for a module run with -m."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    args = sys.argv[1:]
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", sys.argv[0]]
    return " ".join(shlex.quote(a) for a in head + args)


def provenance(argv: list[str] | None = None) -> dict:
    """Device, driver, versions, UTC date, git commit (DSV32REF_GIT_COMMIT when .git is absent), command."""
    import triton

    commit = os.environ.get("DSV32REF_GIT_COMMIT")
    if not commit:  # (a copy without .git, e.g. the device's, passes the commit in; its `git status` means nothing)
        commit = _run(["git", "rev-parse", "HEAD"]) or "unknown"
        if _run(["git", "status", "--porcelain", "--untracked-files=no"]):
            commit += "-dirty"
    gpu = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or platform.machine()})",
        "driver": (_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines() or [None])[0],
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "command": " ".join(shlex.quote(a) for a in argv) if argv is not None else _command(),
    }
