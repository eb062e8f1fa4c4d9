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
# The fonts every deck and page pins in its style, and Debian's package for them: without them
# Chromium silently takes others, of other widths, and the measurements depend on the machine.
FONTS = ("DejaVu Sans", "DejaVu Sans Mono")
FONTS_PACKAGE = "fonts-dejavu-core"
LOCK_DIR = Path.home() / ".cache" / "course-slides"


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROME_PATH"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def missing_fonts() -> list[str]:
    """The pinned fonts (FONTS) that fontconfig does not have."""
    if not shutil.which("fc-list"):
        return list(FONTS)
    proc = subprocess.run(["fc-list", ":", "family"], capture_output=True, text=True, timeout=60)
    have = {f.strip() for line in proc.stdout.splitlines() for f in line.split(",")}
    return [f for f in FONTS if f not in have]


def install_chromium(log: Path) -> str | None:
    """Debian/Ubuntu as root: apt-get install chromium and the pinned fonts."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium",
                     FONTS_PACKAGE]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                              timeout=900).returncode:
                return None
    return find_chromium()


def chromium() -> str | None:
    """The browser, installed on first use where that is possible; None where it is not."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_DIR / "chromium.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_chromium()
        if found and not missing_fonts():
            return found
        return install_chromium(LOCK_DIR / "chromium-apt.log") or found
