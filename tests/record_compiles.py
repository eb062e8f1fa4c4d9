"""Run a training script (argv[1:]) recording how many graphs torch.compile has compiled (first
compiles and recompiles) after every optimizer step and at the end; $COMPILES_FILE gets
{"after_step": [...], "at_exit": n} at exit. (tests/test_precision.py: --compile compiles
training once and evaluation once.)"""

import atexit
import json
import os
import runpy
import sys

from torch._dynamo.utils import counters
from torch.optim.optimizer import register_optimizer_step_post_hook

after_step = []


def compiled() -> int:
    return counters["stats"]["unique_graphs"]


def record(optimizer, args, kwargs):
    after_step.append(compiled())


def write():
    with open(os.environ["COMPILES_FILE"], "w") as f:
        json.dump({"after_step": after_step, "at_exit": compiled()}, f)


register_optimizer_step_post_hook(record)
atexit.register(write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
