"""What the check's fork server imports once, so that every rank it forks starts in
milliseconds instead of importing torch again (about two seconds each).

Each import here is one a rank would otherwise pay for itself: torch.distributed.optim compiles
its functional optimizers with TorchScript on import (half a second, in every rank, as the probe
wraps ZeroRedundancyOptimizer). At the end, gc.freeze() moves everything imported so far out of
the garbage collector's sight: a forked rank's gc.collect() (destroy_process_group's, before it
leaves the group) then walks only the rank's own objects, not torch's (a quarter of a second).
"""

import gc
import importlib

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.optim  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.nn.functional  # noqa: F401
import torch.nn.parallel  # noqa: F401
import torch.profiler  # noqa: F401
import torch.utils.data.distributed  # noqa: F401
import torch.utils.serialization.config  # noqa: F401

import model  # noqa: F401
import selfcheck.probe  # noqa: F401
import selfcheck.standin  # noqa: F401
import utils.args  # noqa: F401
import utils.checkpointing  # noqa: F401
import utils.checks  # noqa: F401
import utils.data  # noqa: F401
import utils.distributed_utils  # noqa: F401
import utils.metrics  # noqa: F401
import utils.monitor  # noqa: F401
import utils.precision  # noqa: F401
import utils.run_lock  # noqa: F401

# what torch imports on first use (a DCP save, the profiler, torch.save): private names, so a
# later torch without them costs an import at most, never the check
for name in ("torch.distributed.checkpoint._fsspec_filesystem", "torch.profiler._cupti_monitor"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass

gc.freeze()
