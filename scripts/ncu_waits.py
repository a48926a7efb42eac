"""Where the warps of a warp-specialised kernel wait, read from Nsight Compute's source page (profiled on a GPU,
read anywhere).

    ncu --set full -k regex:_sparse_mla_pairs_kernel --launch-skip 2 --launch-count 1 -o OUT/pairs \
        python scripts/ncu_sparse_mla.py --prefill 4096 --model glm-5.2 --context 32768
    ncu -i OUT/pairs.ncu-rep --page source --csv --print-source sass > OUT/pairs_sass.csv
    python scripts/ncu_waits.py OUT/pairs_sass.csv

The kernel's SASS is cut into regions at each USETMAXREG (a warp-specialised partition sets its register count
on entry: the regions of the partitions are named by that count, e.g. "232 regs"). For each region: its warp-stall
samples by reason. For each mbarrier try-wait in it (SYNCS.PHASECHK.TRANS64.TRYWAIT on [base + offset]; the offset
names the barrier): how often the wait was reached and how often its retry loop ran. A try-wait suspends the warp
for a while in hardware; it retries when the phase has not completed by then. A consumer whose waits on its stages'
`ready` barriers retry tens of times a wait is starved of data; a producer whose waits on `free` never retry is
never held back by the consumers.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
TRY_WAIT = re.compile(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT\s+(\w+),\s*\[[^\]]*?(0x[0-9a-f]+)?\]")
BRANCH = re.compile(r"^(@!?\w+\s+)?BRA\s+(0x[0-9a-f]+)")  # group 1: the predicate (None: unconditional)
SET_REGS = re.compile(r"USETMAXREG\.\S+\s+(?:\w+,\s*)?(0x[0-9a-f]+)")


def _number(text: str) -> float:
    """A count as ncu writes it ("1,234"); 0 for what is not one ("", "N/A")."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str) -> list[dict]:
    """The rows of `ncu --page source --csv --print-source sass`: address, source (the instruction), samples,
    executions and each stall reason's samples (stall_* columns, not the 'Not Issued' ones)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    head = next((i for i, row in enumerate(lines) if "Address" in row and "Source" in row), None)
    if head is None:
        raise ValueError(f"{path}: no 'Address' and 'Source' header: not ncu's source page as CSV")
    names = lines[head]
    rows = []
    for values in lines[head + 1:]:
        row = dict(zip(names, values))
        if not row.get("Address", "").startswith("0x"):
            continue
        rows.append({"address": int(row["Address"], 16), "source": row["Source"].strip(),
                     "samples": _number(row.get(SAMPLES, "")), "executed": _number(row.get(EXECUTED, "")),
                     "stalls": {k[6:]: _number(v) for k, v in row.items()
                                if k.startswith("stall_") and "Not Issued" not in k}})
    return rows


def regions(rows: list[dict]) -> list[tuple[str, int, int]]:
    """(name, first row, row past the last): the code before the first USETMAXREG ('entry'), then one region per
    USETMAXREG, named by the register count it sets."""
    cuts = [(0, "entry")] + [(i, f"{int(m.group(1), 16)} regs") for i, r in enumerate(rows)
                             if (m := SET_REGS.search(r["source"]))]
    bounds = [i for i, _ in cuts[1:]] + [len(rows)]
    return [(name, start, end) for (start, name), end in zip(cuts, bounds) if end > start]


def _retry_loops(rows: list[dict], at: dict) -> list[tuple[int, int, int]]:
    """(loop's first row, its try-wait's row, the row it returns to): each block [.., try-wait, @!P BRA to the
    block, BRA back] that ptxas places out of line."""
    loops = []
    for k, r in enumerate(rows[:-2]):
        again, back = BRANCH.match(rows[k + 1]["source"]), BRANCH.match(rows[k + 2]["source"])
        if not (TRY_WAIT.search(r["source"]) and again and again.group(1) and back and not back.group(1)):
            continue
        start, ret = at.get(int(again.group(2), 16), k + 1), at.get(int(back.group(2), 16), len(rows))
        if start <= k and ret < k:
            loops.append((start, k, ret))
    return loops


def try_waits(rows: list[dict]) -> list[dict]:
    """Each in-line try-wait that has a retry loop: its row, barrier offset, the times it was reached, the times
    the loop's try-wait ran (its retries) and the samples on it and on its branch to the loop."""
    at = {r["address"]: i for i, r in enumerate(rows)}
    found = []
    for start, k, ret in _retry_loops(rows, at):
        offset = TRY_WAIT.search(rows[k]["source"]).group(2)
        inline = next((i for i in range(ret - 1, -1, -1) if (m := TRY_WAIT.search(rows[i]["source"]))
                       and m.group(2) == offset), None)
        if inline is None:
            continue
        jump = next((j for j in range(inline + 1, ret) if (m := BRANCH.match(rows[j]["source"]))
                     and at.get(int(m.group(2), 16)) == start), inline)
        loop = range(start, k + 3)  # the out-of-line block: its samples are this wait's
        found.append({"row": inline, "barrier": offset or "0x0", "reached": rows[inline]["executed"],
                      "retries": rows[k]["executed"], "loop": loop,
                      "samples": rows[inline]["samples"] + (rows[jump]["samples"] if jump != inline else 0.0)
                      + sum(rows[i]["samples"] for i in loop)})
    return sorted(found, key=lambda w: w["row"])


def report(rows: list[dict]) -> str:
    """Each region's share of the samples and its stall reasons, then its try-waits; a retry loop's rows (placed
    out of line, after the last partition's code) count in the region of the wait they retry."""
    total = sum(r["samples"] for r in rows) or 1.0
    waits = try_waits(rows)
    spans = regions(rows)
    owner = [next(n for n, (_, start, end) in enumerate(spans) if start <= i < end) for i in range(len(rows))]
    for w in waits:
        for i in w["loop"]:
            owner[i] = owner[w["row"]]
    out = []
    for n, (name, start, end) in enumerate(spans):
        part = [r for i, r in enumerate(rows) if owner[i] == n]
        samples = sum(r["samples"] for r in part)
        if not samples:
            continue
        by = Counter()
        for r in part:
            by.update(r["stalls"])
        top = ", ".join(f"{k} {v / samples:.0%}" for k, v in by.most_common(5) if v)
        out.append(f"{name}: {samples / total:.1%} of the samples; {top}")
        for w in (w for w in waits if start <= w["row"] < end):
            per = w["retries"] / w["reached"] if w["reached"] else 0.0
            out.append(f"    try-wait on barrier +{w['barrier']}: reached {w['reached']:.0f}, retried "
                       f"{w['retries']:.0f} ({per:.1f} a wait), {w['samples'] / total:.1%} of the samples")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > this file")
    print(report(read_source_page(ap.parse_args().csv)))


if __name__ == "__main__":
    main()
