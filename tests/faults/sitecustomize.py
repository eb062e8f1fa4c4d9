"""Test-only fault injection for training processes (tests/test_restarts.py puts this folder on
PYTHONPATH; Python imports sitecustomize at start-up). Nothing here is part of the course.

KILL_AT_STEP=N KILL_RANK=R: the process with RANK=R kills itself with SIGKILL right after its
N-th optimizer step, on the first start only (torchrun's TORCHELASTIC_RESTART_COUNT=0), as a
crashed node or an out-of-memory kill would.
"""

import os

if (os.environ.get("KILL_AT_STEP") and os.environ.get("RANK") == os.environ.get("KILL_RANK", "0")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
    import signal

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _steps = [0]

    def _kill_after_step(optimizer, args, kwargs):
        _steps[0] += 1
        if _steps[0] == int(os.environ["KILL_AT_STEP"]):
            print(f"fault injection: rank {os.environ['RANK']} killed after step {_steps[0]}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(_kill_after_step)
