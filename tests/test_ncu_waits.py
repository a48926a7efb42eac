"""scripts/ncu_waits.py on the CPU, over a source page written here in Nsight Compute's CSV form: the regions cut at
each USETMAXREG, each in-line mbarrier try-wait found through its out-of-line retry loop (whose branch back names
where it returns to, not the predicate: ptxas reuses the predicate register before the branch), its retries per
wait, and a file that is not a source page refused by name."""

import csv
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
           "stall_barrier", "stall_long_sb (Not Issued)"]
# address, instruction, samples (all long_sb, or barrier for the MMA), executions
SASS = [
    (0x100, "LDC R1, c[0x0][0x28]", 1, 8),
    (0x110, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0", 0, 8),
    (0x112, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7+0x385d8], RZ", 0, 8),  # the first block's, before the loop
    (0x114, "@!P1  BRA 0x4a0", 0, 8),
    (0x116, "NOP", 0, 8),
    (0x120, "MOV R16, UR17", 0, 100),
    (0x130, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7+0x385d8], R16", 2, 100),
    (0x140, "ISETP.NE.AND P1, PT, R3, RZ, PT", 0, 100),
    (0x150, "@!P2  BRA 0x400", 30, 100),
    (0x160, "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152", 10, 100),
    (0x170, "SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [R3+URZ+0x38600], RZ", 1, 4),
    (0x180, "@!P3  BRA 0x470", 0, 4),
    (0x190, "USETMAXREG.DEALLOC.CTAPOOL 0x40", 0, 8),
    (0x1a0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P6, [UR7+0x385e0], R27", 1, 100),
    (0x1b0, "@!P6  BRA 0x440", 5, 100),
    (0x1c0, "EXIT", 0, 8),
    (0x400, "MOV R16, UR17", 0, 5400),
    (0x410, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7+0x385d8], R16", 5, 5400),  # a starved warp's samples
    (0x420, "@!P1  BRA 0x400", 0, 5400),
    (0x430, "BRA 0x160", 0, 100),
    (0x440, "SYNCS.PHASECHK.TRANS64.TRYWAIT P6, [UR7+0x385e0], R27", 0, 0),
    (0x450, "@!P6  BRA 0x440", 0, 0),
    (0x460, "BRA 0x1c0", 0, 0),
    (0x470, "SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR7+0x38600], RZ", 0, 12),
    (0x480, "@!P3  BRA 0x470", 0, 12),
    (0x490, "BRA 0x190", 0, 4),
    (0x4a0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7+0x385d8], RZ", 0, 40),
    (0x4b0, "@!P1  BRA 0x4a0", 0, 40),
    (0x4c0, "BRA 0x116", 0, 8),
]


@pytest.fixture(scope="module")
def waits():
    spec = importlib.util.spec_from_file_location("ncu_waits", os.path.join(ROOT, "scripts", "ncu_waits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "_sparse_mla_pairs_kernel", ""])
        w.writerow(COLUMNS)
        for address, source, samples, executed in SASS:
            mma = source.startswith("HGMMA")
            w.writerow([f"0x{address:x}", f"      {source}", f"{samples:,}", f"{executed:,}",
                        0 if mma else samples, samples if mma else 0, 99])
    return path


def test_each_try_wait_is_found_through_its_retry_loop(waits, tmp_path):
    rows = waits.read_source_page(_page(tmp_path / "page.csv"))
    assert [name for name, _, _ in waits.regions(rows)] == ["entry", "208 regs", "64 regs"]
    got = [(rows[w["row"]]["address"], w["barrier"], w["reached"], w["retries"], w["samples"])
           for w in waits.try_waits(rows)]
    assert got == [(0x112, "0x385d8", 8, 40, 0), (0x130, "0x385d8", 100, 5400, 37), (0x170, "0x38600", 4, 12, 1),
                   (0x1a0, "0x385e0", 100, 0, 6)]


def test_the_report_gives_each_regions_stalls_and_its_waits_retries(waits, tmp_path):
    text = waits.report(waits.read_source_page(_page(tmp_path / "page.csv"))).splitlines()
    assert text == [  # the retry loop's 5 samples (placed after the 64-register code) count where they wait
        "entry: 1.8% of the samples; long_sb 100%",
        "208 regs: 87.3% of the samples; long_sb 79%, barrier 21%",
        "    try-wait on barrier +0x385d8: reached 8, retried 40 (5.0 a wait), 0.0% of the samples",
        "    try-wait on barrier +0x385d8: reached 100, retried 5400 (54.0 a wait), 67.3% of the samples",
        "    try-wait on barrier +0x38600: reached 4, retried 12 (3.0 a wait), 1.8% of the samples",
        "64 regs: 10.9% of the samples; long_sb 100%",
        "    try-wait on barrier +0x385e0: reached 100, retried 0 (0.0 a wait), 10.9% of the samples",
    ]


def test_a_file_that_is_not_a_source_page_is_refused(waits, tmp_path):
    other = tmp_path / "details.csv"
    other.write_text('"ID","Metric Name","Metric Value"\n"0","Duration","2.15"\n')
    with pytest.raises(ValueError, match=r"details.csv: no 'Address' and 'Source' header"):
        waits.read_source_page(str(other))
