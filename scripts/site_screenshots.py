"""Screenshots of the documentation site for docs/images/: build it strictly into a temporary folder, serve it on
127.0.0.1 (a free port, Python's http.server in a thread) and take each page in Debian's headless chromium through
Playwright, as tests/browser does (``SGPU_MAGIC_CHROMIUM`` picks another chromium).

    .venv/bin/python scripts/site_screenshots.py                 # docs/images/site-home.png, site-guide.png
    .venv/bin/python scripts/site_screenshots.py --out /tmp/shots --page reference/job/
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("SGPU_MAGIC_CHROMIUM", "/usr/bin/chromium")
PAGES = {"site-home.png": "", "site-guide.png": "guide/decorator/"}
# as tests/browser/conftest.py: a sandboxed root run on a machine with no outside network
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:
        pass


def build(site: Path) -> None:
    """``mkdocs build --strict`` into ``site``; exits with mkdocs' output when it fails."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    if run.returncode:
        sys.exit(f"mkdocs build --strict failed:\n{run.stdout}{run.stderr}")


def shoot(site: Path, shots: dict[str, str], out: Path, width: int, height: int) -> None:
    from playwright.sync_api import sync_playwright

    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    out.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width, "height": height})
            for name, path in shots.items():
                page.goto(base + path, wait_until="networkidle")
                page.screenshot(path=str(out / name))
                print(f"{out / name}: {base + path}")
            browser.close()
    finally:
        server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the PNGs")
    parser.add_argument(
        "--page",
        action="append",
        default=[],
        help="a page's path in the site (instead of the home page and the decorator's guide page); repeatable",
    )
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    options = parser.parse_args()
    shots = {f"page-{i}.png": p for i, p in enumerate(options.page)} if options.page else PAGES
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        shoot(site, shots, options.out, options.width, options.height)


if __name__ == "__main__":
    main()
