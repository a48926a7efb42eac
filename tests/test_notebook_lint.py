"""The stored notebooks as a reader gets them: outputs that fit the page, no machine's paths, nothing cited that
is not in the repository, every figure checked (dsv32ref.report.show) and every notebook ending on its
conclusion."""

import json
import re
from pathlib import Path

import pytest

from dsv32ref.report import METADATA_KEY

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
PR_TITLE = "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region"
WIDTH = 110
ABSOLUTE = re.compile(r"(?<![\w.])(/work/|/root/|/home/|/tmp/|/usr/|/opt/|[A-Z]:\\\\)")
OUTSIDE = re.compile(r"FACTS\.md|STYLE\.md|\.\./shared|\bissue \d+", re.IGNORECASE)
JARGON = re.compile(r"\bseeds?\b(?!\.json)", re.IGNORECASE)  # in prose: the PR has a name


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _text_outputs(cell):
    """(kind, text) of every output a reader sees as text: streams, errors, and text/plain when nothing richer
    is shown beside it."""
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            yield "stream", "".join(o["text"])
        elif o["output_type"] == "error":
            yield "error", "\n".join(o["traceback"])
        else:
            data = o.get("data", {})
            if "text/plain" in data and not ({"text/html", "text/markdown", "image/png"} & set(data)):
                yield "text/plain", "".join(data["text/plain"])


def _source(cell):
    return "".join(cell["source"])


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def notebook(request):
    return request.param


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6


def test_no_output_line_is_wider_than_the_page(notebook):
    long = [(i, kind, line[:60] + "...") for i, c in enumerate(_cells(notebook)) if c["cell_type"] == "code"
            for kind, text in _text_outputs(c) for line in text.splitlines() if len(line) > WIDTH]
    assert not long, f"{len(long)} stored output lines over {WIDTH} characters, e.g. {long[:3]}"


def test_no_error_outputs(notebook):
    errors = [i for i, c in enumerate(_cells(notebook)) if any(k == "error" for k, _ in _text_outputs(c))]
    assert not errors, f"cells {errors} store an error"


def test_no_absolute_paths_and_nothing_outside_the_repository(notebook):
    bad = []
    for i, c in enumerate(_cells(notebook)):
        prose = [t for _, t in _text_outputs(c)]
        for o in c.get("outputs", []):
            prose += ["".join(o.get("data", {}).get(m, "")) for m in ("text/markdown", "text/html")]
        if c["cell_type"] == "markdown":
            prose.append(_source(c))
        checks = [(t, (ABSOLUTE, OUTSIDE, JARGON)) for t in prose] + [(_source(c), (ABSOLUTE, OUTSIDE))]
        for t, rxs in checks:
            for rx in rxs:
                m = rx.search(t)
                if m:
                    bad.append((i, t[max(m.start() - 30, 0): m.end() + 30]))
    assert not bad, f"cells cite a path, a file outside the repository or 'the seeds': {bad[:4]}"


def test_every_figure_was_checked_and_has_a_title_and_labels(notebook):
    figures = 0
    for i, c in enumerate(_cells(notebook)):
        if c["cell_type"] != "code":
            continue
        assert "plt.show()" not in _source(c), f"cell {i}: show figures with dsv32ref.report.show(fig)"
        for o in c.get("outputs", []):
            if "image/png" not in o.get("data", {}):
                continue
            figures += 1
            meta = o.get("metadata", {}).get("image/png", {}).get(METADATA_KEY)
            assert meta is not None, f"cell {i}: a figure not shown through dsv32ref.report.show"
            for a in meta["axes"]:
                assert a["xlabel"] and a["ylabel"], (i, a)
                assert a["title"], (i, a)
            assert meta["figure_legends"] == 0, i
            assert all(meta.get("colorbars", [])), (i, "a colorbar without a label")
    if "02_" in notebook.name or "06_" in notebook.name:
        assert figures >= 3, f"{figures} figures"


def test_every_notebook_names_the_pr_and_ends_on_its_conclusion(notebook):
    cells = _cells(notebook)
    assert PR_TITLE in "".join(_source(c) for c in cells), "the PR is not named"
    assert cells[0]["cell_type"] == "markdown" and _source(cells[0]).startswith("# "), "no title and opening"
    heads = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and
             re.search(r"^## Conclusion", _source(c), re.M)]
    assert heads, "no '## Conclusion' section"
    for c in cells[heads[-1] + 1:]:  # after it: prose only (markdown cells, or cells that render Markdown)
        if c["cell_type"] == "code":
            kinds = {m for o in c.get("outputs", []) for m in o.get("data", {})} | \
                {o["output_type"] for o in c.get("outputs", []) if o["output_type"] == "stream"}
            assert kinds <= {"text/markdown", "text/plain"}, f"conclusion cell shows {kinds}"
