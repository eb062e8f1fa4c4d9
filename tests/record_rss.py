"""Run a training script (argv[1:]) recording this process's resident memory after every
optimizer step; $RSS_FILE gets the list (MiB, one entry per step) at exit.
(tests/test_resident_memory.py: no script grows step after step.)"""

import atexit
import json
import os
import runpy
import sys

import psutil
from torch.optim.optimizer import register_optimizer_step_post_hook

process = psutil.Process()
rss = []


def record(optimizer, args, kwargs):
    rss.append(process.memory_info().rss / 2**20)


def write():
    with open(os.environ["RSS_FILE"], "w") as f:
        json.dump(rss, f)


register_optimizer_step_post_hook(record)
atexit.register(write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
