"""Writing results under data/: atomically, and never a partial run over a complete one.

`write_result(path, result)` writes a complete result: into a temporary file beside `path`, flushed to disk,
then renamed over `path` (a rename within one directory is atomic), so a reader or a crash sees the old file
or the new one, never half of one. Any partial file of the same result is removed.

`write_partial(path, result)` records progress of a run still going: the same, but to the partial path
(`ttft_glm-5.2.json` -> `ttft_glm-5.2.partial.json`) with `"partial": true`, leaving a complete result at
`path` untouched. A run that stops early (an error, Ctrl-C, out of memory) leaves its progress there.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from typing import Any

from dsv32ref.checks import check_readable, check_replaceable

__all__ = ["DATA_DIR", "partial_path", "read_result", "reading", "run_dir", "write_partial", "write_result",
           "write_atomic"]

# The repository's data/ (beside the package): what the commands read as the recorded runs, wherever they run from.
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def run_dir() -> str:
    """runs/<UTC time>/: where a live run writes unless asked to record into data/."""
    return os.path.join("runs", datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))


def partial_path(path: str | os.PathLike) -> str:
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.partial{ext or '.json'}"


def write_atomic(path: str | os.PathLike, write) -> None:
    """Call write(file_path) on a temporary file in path's directory, then rename it over `path`.

    `write` receives a path (so libraries that write files themselves, e.g. safetensors, can use it). If it
    raises, or the process is interrupted, `path` is left as it was and the temporary file is removed."""
    check_replaceable("path", os.fspath(path))
    path = os.path.realpath(path)  # a link's target is what is replaced (the link stays)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _dump_json(obj: Any):
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=str)
            f.write("\n")
    return write


def write_result(path: str | os.PathLike, result: dict) -> None:
    """The complete result of a run, atomically at `path`; its partial file (if any) is removed."""
    if result.get("partial"):
        raise ValueError(f"write_result: {os.fspath(path)!r}: the result is marked partial; use write_partial")
    write_atomic(path, _dump_json(result))
    stale = partial_path(path)
    if os.path.isfile(stale):
        os.unlink(stale)


def read_result(path: str | os.PathLike) -> dict | None:
    """A result file's JSON object; None where there is no file. A FIFO or folder there, JSON that does not parse
    or is not an object: ValueError naming the file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return None
    check_readable("result", path)
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path!r}: not a readable result ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(result, dict):
        raise ValueError(f"{path!r}: expected a result (a JSON object), got a JSON {type(result).__name__}")
    return result


@contextlib.contextmanager
def reading(what: str):
    """A field a reader of result files looks up and does not find, or finds of another kind: ValueError naming
    `what` (the files) and the field, not a KeyError or TypeError from inside the reader."""
    try:
        yield
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{what}: not the results this reads ({type(e).__name__}: {e})"[:300]) from e


def write_partial(path: str | os.PathLike, result: dict) -> str:
    """Progress of a run still going, at partial_path(path), marked `"partial": true`. Returns that path."""
    p = partial_path(path)
    write_atomic(p, _dump_json({**result, "partial": True}))
    return p


def progress(i: int, n: int, label: str) -> None:
    """A one-line progress bar on stdout, redrawn about 20 times over n steps."""
    if i == n or i % max(n // 20, 1) == 0:
        bar = "#" * (30 * i // n)
        print(f"\r  {label:<28} [{bar:<30}] {i}/{n}", end="\n" if i == n else "", flush=True)
