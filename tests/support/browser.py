"""Chromium as the browser tests and bench/web.py launch it (Playwright drives Debian's build)."""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("MUONFORGE_TEST_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = [  # headless, and no calls home (the machine may have no network at all)
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
