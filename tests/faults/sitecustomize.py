"""Test-only fault injection for training processes (the tests put this folder on PYTHONPATH;
Python imports sitecustomize at start-up). Nothing here is part of the course.

Faults fire on the first start only (torchrun's TORCHELASTIC_RESTART_COUNT and Slurm's
SLURM_RESTART_COUNT unset or 0), in the training process whose RANK (torchrun) or SLURM_PROCID
(srun) is KILL_RANK (default 0):

KILL_AT_STEP=N: the process kills itself with SIGKILL right after its N-th optimizer step, as
    a crashed node or an out-of-memory kill would.
KILL_AT=EVENT:N[:SIGNAL]: at the N-th time EVENT happens in this process, SIGNAL (KILL, the
    default: this process; TERM: the whole job, i.e. SIGTERM to the launcher, torchrun or
    the emulated srun, which passes it on to every process, as scancel and a time limit do;
    this process then waits to be stopped). Events, in the order a save goes through them:
      step      an optimizer step has finished
      shards    a rank wrote its DCP shard file (inside a save, before any marker)
      marker    rank 0 wrote a checkpoint's manifest and synced it (before the renames)
      rename    os.replace inside a checkpoint folder (the 1st of a save: NAME -> .NAME.old;
                the 2nd: .NAME.partial -> NAME)
      torchsave a torch.save to a temporary file has written its data (Lightning's .ckpt,
                the exported models), before the rename
      time      N seconds after the process started (N may have decimals)
NAN_AT_STEP=N: after this process's N-th training step (optimizer steps with gradients),
    every parameter is filled with NaN, as a diverging run's would be: its next
    loss is NaN.
DISK_FULL_UNDER=DIR [DISK_FULL_AFTER_BYTES=N]: every write into a file under DIR, once this
    process has written N bytes there (default 0), fails with ENOSPC, as on a full disk or
    quota. Works for any user (a real full file system needs root to mount).
"""

import errno
import os

_first_start = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                and os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"))
# a training process, started by torchrun (RANK) or by srun (SLURM_PROCID); never the launcher
# itself (torchrun, the emulated srun), which sees the same KILL_AT otherwise
_rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
_chosen = _rank is not None and _rank == os.environ.get("KILL_RANK", "0")


def _signal(what: str) -> None:
    import signal
    import time
    kind = os.environ.get("KILL_AT", "").split(":")[2:] or ["KILL"]
    print(f"fault injection: rank {_rank} {'SIGTERM to the job' if kind[0] == 'TERM' else 'killed'}"
          f" {what}", flush=True)
    if kind[0] == "TERM":
        os.kill(int(os.environ.get("FAULT_JOB_PID") or os.getppid()), signal.SIGTERM)
        time.sleep(600)  # until the launcher stops this process
    os.kill(os.getpid(), signal.SIGKILL)


if _first_start and _chosen and os.environ.get("KILL_AT_STEP"):
    os.environ["KILL_AT"] = f"step:{os.environ['KILL_AT_STEP']}"

if _first_start and _chosen and os.environ.get("KILL_AT"):
    _event, _n = os.environ["KILL_AT"].split(":")[:2]
    _counts = {}

    def _happened(event: str) -> None:
        if event != _event:
            return
        _counts[event] = _counts.get(event, 0) + 1
        if _counts[event] == int(float(_n)):
            _signal(f"after {event} {_n}" if event != "step" else f"after step {_n}")

    if _event == "time":
        import threading
        import time
        threading.Thread(target=lambda: (time.sleep(float(_n)), _signal(f"after {_n} s")),
                         daemon=True).start()
    elif _event == "step":
        from torch.optim.optimizer import register_optimizer_step_post_hook
        register_optimizer_step_post_hook(lambda *args: _happened("step"))
    elif _event == "shards":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        _write_data = FileSystemWriter.write_data

        def _write_and_count(self, plan, planner):
            future = _write_data(self, plan, planner)
            future.wait()
            _happened("shards")
            return future

        FileSystemWriter.write_data = _write_and_count
    elif _event in ("marker", "rename"):
        _replace = os.replace

        def _replace_and_count(src, dst, *args, **kwargs):
            # the two renames of a checkpoint save: NAME -> .NAME.old, .NAME.partial -> NAME
            if os.fspath(src).endswith(".partial") or os.fspath(dst).endswith(".old"):
                _happened("rename")
            return _replace(src, dst, *args, **kwargs)

        os.replace = _replace_and_count
        if _event == "marker":  # the marker is written, then its folder is synced: count that
            _os_open = os.open

            def _open_and_count(path, flags, *args, **kwargs):
                fd = _os_open(path, flags, *args, **kwargs)
                if os.fspath(path).endswith(".partial") and flags == os.O_RDONLY:
                    _happened("marker")
                return fd

            os.open = _open_and_count
    elif _event == "torchsave":
        import torch
        _save = torch.save

        def _save_and_count(obj, f, *args, **kwargs):
            result = _save(obj, f, *args, **kwargs)
            try:  # utils/files.py saves into an os.fdopen file: its name is a number
                name = os.readlink(f"/proc/self/fd/{f.fileno()}")
            except (AttributeError, OSError, ValueError):
                name = str(f)
            if name.endswith(".tmp"):
                _happened("torchsave")
            return result

        torch.save = _save_and_count


if os.environ.get("NAN_AT_STEP"):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _nan_steps = [0]

    def _poison(optimizer, args, kwargs):
        import torch
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if not any(int(torch.count_nonzero(g)) for g in local):
            return  # DCP's loading makes one step with zero gradients: not a training step
        _nan_steps[0] += 1
        if _nan_steps[0] == int(os.environ["NAN_AT_STEP"]):
            import torch
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.fill_(float("nan"))

    register_optimizer_step_post_hook(_poison)


if os.environ.get("DISK_FULL_UNDER"):
    import builtins
    import io

    _under = os.path.realpath(os.environ["DISK_FULL_UNDER"])
    _budget = [int(os.environ.get("DISK_FULL_AFTER_BYTES") or 0)]

    class _FullDiskFile:
        """A file opened for writing under DISK_FULL_UNDER: writes fail once the budget is
        spent; everything else goes to the real file."""

        def __init__(self, f, path):
            self._f, self._path = f, os.fsdecode(path)

        def write(self, data):
            if len(data) > _budget[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
            _budget[0] -= len(data)
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __iter__(self):
            return iter(self._f)

    def _wrap(f, path, mode):
        writing = isinstance(mode, str) and any(c in mode for c in "wax+")
        if writing and isinstance(path, (str, bytes, os.PathLike)) and \
                os.path.realpath(os.fsdecode(path)).startswith(_under + os.sep):
            return _FullDiskFile(f, path)
        return f

    _open = builtins.open

    def _open_full(file, mode="r", *args, **kwargs):
        return _wrap(_open(file, mode, *args, **kwargs), file, mode)

    builtins.open = io.open = _open_full
    _fdopen = os.fdopen

    def _fdopen_full(fd, mode="r", *args, **kwargs):
        f = _fdopen(fd, mode, *args, **kwargs)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return f
        return _wrap(f, path, mode)

    os.fdopen = _fdopen_full
