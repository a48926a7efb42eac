"""Build notebooks from their percent-format sources in src/ and execute them in place.

    python notebooks/build.py [NAME ...]

`# %% [markdown]` starts a markdown cell, `# %%` a code cell; `# %% nbval-ignore` marks a cell whose
output nbval must not compare (timings). Executed outputs are the regression baseline for
`pytest --nbval`: rebuild after changing a notebook or what it calls, and review the diff.
"""

import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).parent


def parse(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cells, kind, tags, lines = [], None, [], []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        else:
            cell = nbformat.v4.new_code_cell(body)
            if tags:
                cell.metadata["tags"] = tags
            cells.append(cell)

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            rest = line[4:].strip()
            kind = "markdown" if rest.startswith("[markdown]") else "code"
            tags = ["nbval-ignore-output"] if "nbval-ignore" in rest else []
            lines = []
        else:
            lines.append(line)
    flush()
    nb.cells = cells
    return nb


def build(name: str) -> None:
    src = HERE / "src" / f"{name}.py"
    nb = parse(src.read_text())
    NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"{name[:2]}-{i:03d}"
    nbformat.write(nb, HERE / f"{name}.ipynb")
    print(f"built {name}.ipynb ({len(nb.cells)} cells)")


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.stem for p in (HERE / "src").glob("*.py"))
    for n in names:
        build(n)
