"""Run a training script (argv[1:]) counting DDP's gradient all-reduces: one per bucket and
synchronised backward. Each rank writes its count to $COUNT_DIR/allreduces-rank<N>.txt at exit.
(tests/test_memory_lesson.py: gradient accumulation all-reduces once per optimizer step.)"""

import atexit
import os
import runpy
import sys
from pathlib import Path

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

count = 0
original_init = DistributedDataParallel.__init__


def counting_hook(state, bucket):
    global count
    count += 1
    return default_hooks.allreduce_hook(state, bucket)


def init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self.register_comm_hook(self.process_group, counting_hook)


def write_count():
    Path(os.environ["COUNT_DIR"], f"allreduces-rank{os.environ.get('RANK', '0')}.txt"
         ).write_text(str(count))


DistributedDataParallel.__init__ = init
atexit.register(write_count)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
