"""Screenshots of every notebook as JupyterLab renders it, in headless Chromium: what a reader sees.

Usage (repo root; needs `pip install playwright` and a Chromium, e.g. Debian's `apt-get install chromium`):
    .venv/bin/python scripts/screenshots.py [OUTDIR] [--width 1000]
Starts a JupyterLab server on a free port without a token, opens each stored notebook (nothing is run),
and saves OUTDIR/<notebook>-<k>.png, one viewport-high page at a time from the top. The browser window is
`--width` pixels wide with the sidebars collapsed: the page width tables and figures must fit in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.token=",
           "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={ROOT}",
           "--LabApp.news_url=", "--ServerApp.allow_root=True"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/lab", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("JupyterLab did not start within 60 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="screenshots")
    ap.add_argument("--width", type=int, default=1000, help="pixels of the browser window")
    ap.add_argument("--height", type=int, default=1400, help="pixels per page")
    ap.add_argument("--max-pages", type=int, default=40)
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    lab = start_lab(port)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
                page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{nb.name}?reset")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                page.wait_for_timeout(3000)  # outputs, images and MathJax
                if page.is_visible("#jp-left-stack"):  # the file browser: collapse it
                    page.keyboard.press("Control+b")
                no = page.locator(".jp-toast-button:has-text('No')")
                if no.count():  # "Would you like to get notified about official Jupyter news?"
                    no.first.click()
                page.keyboard.press("Escape")
                page.wait_for_timeout(500)
                scroller = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
                height = page.eval_on_selector(scroller, "e => e.scrollHeight")
                view = page.eval_on_selector(scroller, "e => e.clientHeight")
                k = 0
                for k in range(min(args.max_pages, -(-height // view))):
                    page.eval_on_selector(scroller, f"e => e.scrollTo(0, {k * view})")
                    page.wait_for_timeout(700)
                    page.screenshot(path=str(out / f"{nb.stem}-{k:02d}.png"))
                print(f"{nb.name}: {k + 1} pages", flush=True)
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=20)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
