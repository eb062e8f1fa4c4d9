"""Headless Chromium for the tests that look at pages (tests/test_slides.py, tests/test_pages.py):
found on the PATH (or CHROME_PATH), else installed with apt-get as root on Debian/Ubuntu, with the
fonts the measurements assume. One installer at a time (a file lock), so two test files that
need it in one session install it once."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
LOCK_DIR = Path.home() / ".cache" / "course-slides"


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROME_PATH"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def install_chromium(log: Path) -> str | None:
    """Debian/Ubuntu as root: apt-get install chromium (and the fonts the measurements assume)."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium",
                     "fonts-dejavu-core"]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                              timeout=900).returncode:
                return None
    return find_chromium()


def chromium() -> str | None:
    """The browser, installed on first use where that is possible; None where it is not."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_DIR / "chromium.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return find_chromium() or install_chromium(LOCK_DIR / "chromium-apt.log")
