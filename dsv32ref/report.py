"""How the notebooks show results. Figures: a colour-blind-safe palette and `show`, which refuses a figure that a
reader could not read on its own (an axes without a title or axis labels, a colorbar without a label, a legend
outside the axes) and stores what it checked beside the image, so a test over the stored notebooks can check
it again. Tables: `table`, rendered as Markdown (never wrapped like printed columns)."""

from __future__ import annotations

# Okabe and Ito's palette: distinguishable with every common colour-vision deficiency.
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#56B4E9", "#CC79A7", "#D55E00", "#F0E442", "#000000"]
GREY = "#999999"

METADATA_KEY = "dsv32ref_figure"


def describe(fig) -> dict:
    """Titles, axis labels and legend placement of every axes that carries a plot. An axes under a figure
    title (suptitle) counts as titled; one that shares its x (y) axis with a labelled one counts as labelled."""
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    axes = [ax for ax in fig.axes if (ax.has_data() or ax.get_title()) and ax not in bars]
    suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""

    def shared_label(ax, axis):  # its own label, or that of an axes it shares the axis with (stacked panels)
        group = ax.get_shared_x_axes() if axis == "x" else ax.get_shared_y_axes()
        for other in [ax] + [o for o in group.get_siblings(ax) if o is not ax]:
            label = other.get_xlabel() if axis == "x" else other.get_ylabel()
            if label.strip():
                return label
        return ""

    return {"suptitle": suptitle,
            "axes": [{"title": ax.get_title() or suptitle, "xlabel": shared_label(ax, "x"),
                      "ylabel": shared_label(ax, "y"), "legend": ax.get_legend() is not None} for ax in axes],
            "colorbars": [ax.get_ylabel() or ax.get_xlabel() for ax in bars],
            "figure_legends": len(fig.legends)}


def check(fig) -> dict:
    """describe(fig), or ValueError naming the first axes that lacks a title or a label."""
    d = describe(fig)
    if not d["axes"]:
        raise ValueError("figure: no axes with data")
    for i, a in enumerate(d["axes"]):
        missing = [k for k in ("title", "xlabel", "ylabel") if not a[k].strip()]
        if missing:
            raise ValueError(f"figure: axes {i} ({a['title'] or 'untitled'}) has no {', '.join(missing)}")
    if not all(label.strip() for label in d["colorbars"]):
        raise ValueError("figure: a colorbar has no label (colorbar.set_label)")
    if d["figure_legends"]:
        raise ValueError("figure: a legend belongs inside an axes (ax.legend), not on the figure")
    return d


def show(fig) -> None:
    """Check the figure, display it with its description as output metadata, and close it."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    d = check(fig)
    fig.tight_layout()
    display(fig, metadata={"image/png": {METADATA_KEY: d}})
    plt.close(fig)


def table(header: list[str], rows: list[list], floatfmt: str = ".2f") -> None:
    """Display rows as a Markdown table; floats formatted with `floatfmt`, None as '-'."""
    from IPython.display import Markdown, display

    def cell(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return format(x, floatfmt)
        return str(x).replace("|", "\\|")

    for i, r in enumerate(rows):
        if len(r) != len(header):
            raise ValueError(f"table: row {i} has {len(r)} cells, the header {len(header)}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    display(Markdown("\n".join(lines)))
