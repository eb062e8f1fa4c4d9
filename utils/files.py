"""Files a run writes: whole or not at all, checked when read back, and a full disk in one line.

- Atomic writes: every file goes to a temporary name in its own folder, is flushed to the disk
  (fsync), and only then renamed over the old one. A kill, a node failure or a full disk at any
  moment leaves either the old file or the new one, never half of one. (Folders of sharded
  checkpoints are made whole the same way: `atomic_folder` in utils/checkpointing.py.)
- Checksums: torch.save writes a CRC-32 of every record into its zip archive, but torch.load
  never checks it, so a bit flipped on a parallel file system or by a bad copy is read as if it
  were fine. `torch_file_problem` checks them; DCP checkpoint folders carry a manifest of
  CRC-32s (`crc32_file`).
- A full disk or quota: `DiskFullError` ends the process with one line naming the path, the
  free space and what to do (instead of a traceback that names neither).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

CHUNK = 1 << 22  # 4 MiB: large enough for zlib's fast path, small enough for little memory


# ---------------------------------------------------------------------------- atomic writes

def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (a node that fails right after it keeps it)."""
    with contextlib.suppress(OSError):  # some file systems refuse fsync on a folder: harmless
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb"):
    """open(path, mode) for writing, but the file appears under `path` only when complete.

    Writes to .NAME.XXXX.tmp beside it (the same file system, so the rename is atomic), then
    fsync and os.replace. On any error, or a kill, `path` keeps its old content; the
    temporary file is deleted (after a kill it stays hidden: readers never pick it).
    A full disk raises DiskFullError.
    """
    path = Path(path)
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private; a run's files are meant to be shared in the project
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, Exception) and is_disk_full(e):
            raise DiskFullError(path) from e
        raise
    fsync_folder(path.parent)


def _temporary(path: Path):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        if is_disk_full(e):
            raise DiskFullError(path) from e
        raise


def write_synced(path: str | os.PathLike, data: str | bytes) -> None:
    """Write a file and flush it to the disk (fsync), not atomically: for files inside a folder
    that is itself renamed into place only when complete (utils/checkpointing.py)."""
    with open(path, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def finite_json(obj):
    """`obj` with every NaN and infinity replaced by None: JSON has no NaN (json.dumps would
    write the bare word NaN, which other tools, and JSON itself, reject)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Valid JSON, written atomically; NaN and infinities become null."""
    atomic_write_text(path, json.dumps(finite_json(obj), indent=1, allow_nan=False) + "\n")


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """torch.save, atomically (see atomic_open)."""
    import torch
    try:
        with atomic_open(path, "wb") as f:
            torch.save(obj, f)
    except DiskFullError as e:
        raise DiskFullError(path, _tensor_bytes(obj)) from e
    except Exception as e:
        if is_disk_full(e):  # torch.save's short write: "inline_container.cc ... unexpected pos"
            raise DiskFullError(path, _tensor_bytes(obj)) from e
        raise


def _tensor_bytes(obj) -> int:
    """About how many bytes torch.save writes for `obj`: its tensors' bytes."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# ---------------------------------------------------------------------------- a full disk

def is_disk_full(error: BaseException) -> bool:
    """A full disk or quota, however it surfaced: OSError ENOSPC/EDQUOT, or torch.save's
    "inline_container.cc: unexpected pos" / "file write failed" (a short write), possibly
    inside DCP's CheckpointException, which carries every failed rank's exception."""
    errors = [error]
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's exception
    if isinstance(failures, dict):
        errors += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    cause = error.__cause__ or error.__context__
    if cause is not None and cause is not error:
        errors.append(cause)
    for e in errors:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "Disk quota exceeded",
                                     "unexpected pos", "file write failed")):
            return True
    return False


def free_mib(path: str | os.PathLike) -> float:
    """Free MiB on the file system of `path` (or of the nearest folder above it that exists)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return float("nan")


def disk_full_message(path: str | os.PathLike, needed_bytes: float | None = None,
                      flag: str = "--out-dir") -> str:
    """One line: what could not be saved, how much to free, and the way out."""
    path = Path(path)
    free = free_mib(path.parent)
    if needed_bytes:
        need = needed_bytes / 2**20
        return (f"no space left on device while saving {path}: free {max(need - free, 0.1):.1f} "
                f"MiB there (it takes about {need:.1f} MiB, {free:.1f} MiB are free) or choose "
                f"another {flag}")
    return (f"no space left on device while saving {path}: {free:.1f} MiB are free in "
            f"{path.parent}: free space there (old runs, checkpoints) or choose another {flag}")


class DiskFullError(SystemExit):
    """A save that failed on a full disk or quota. Uncaught, the process ends with status 1
    and one line on stderr (`error: no space left on device while saving ...`), printed by the
    process that failed; under torchrun the other ranks are then stopped by torchrun."""

    def __init__(self, path: str | os.PathLike, needed_bytes: float | None = None):
        self.path, self.line = Path(path), disk_full_message(path, needed_bytes)
        super().__init__(f"error: {self.line}")  # what Python prints for an uncaught SystemExit

    def __str__(self) -> str:
        return self.line


def one_line_for_a_full_disk(folder: str | os.PathLike) -> None:
    """From now on, an uncaught full-disk error anywhere (a logger's event file, a library's
    own save) ends the process with one line naming the file or `folder`, not a traceback.
    Other exceptions keep their tracebacks."""
    previous = sys.excepthook

    def hook(kind, error, tb):
        if isinstance(error, Exception) and is_disk_full(error):
            where = getattr(error, "filename", None)
            where = where if isinstance(where, (str, os.PathLike)) else Path(folder) / "..."
            print(f"error: {disk_full_message(where)}", file=sys.stderr, flush=True)
            return
        previous(kind, error, tb)

    sys.excepthook = hook


# ---------------------------------------------------------------------------- checksums

def crc32_file(path: str | os.PathLike) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits (zlib: several GB/s, the checksum
    torch.save and zip use; SHA-256 would guard against tampering too, at a third the speed)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def torch_file_problem(path: str | os.PathLike) -> str | None:
    """Why the torch.save file `path` is damaged, or None: checks the CRC-32 of every record
    of its zip archive (written by torch.save, never checked by torch.load). Reads the whole
    file once: about 0.15 s per GB here (docs/benchmarks.md)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as record:  # zipfile checks the CRC-32 at the end
                    while record.read(CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        m = re.match(r"Bad CRC-32 for file '(.*)'", str(e))
        if m:
            return f"its record {m.group(1)} does not match its checksum (CRC-32)"
        return "it is truncated (or not a torch.save file)"
    except (OSError, EOFError) as e:
        return f"it cannot be read ({type(e).__name__}: {e})"
    return None
