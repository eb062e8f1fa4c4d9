"""What runs inside every rank of a checked script: the participant's main(), watched.

    python -m selfcheck.probe SCRIPT [script arguments]    (started by selfcheck.runs)

Before the script is imported, the probe wraps the classes and helpers the lessons use
(samplers, DataLoader, DDP, the course's helpers, torch.distributed's collectives, print, ...)
so that it can record what the script built, called and printed, and from which of its own
lines. After main() returns or fails it writes everything to CHECK_DUMP_DIR/rank<R>.json:
the checks judge a TODO by this behaviour, never by the text of the file.

A rank that is stuck can be asked for its stack: SIGUSR1 writes it to rank<R>.stack.
"""

from __future__ import annotations

import builtins
import contextlib
import faulthandler
import functools
import gc
import importlib.util
import io
import json
import math
import os
import signal
import sys
import time
import traceback
import weakref
from pathlib import Path

# The modules of the check's fork server when it forked this rank (selfcheck/runs.py sets it):
# the torch modules a rank imports beyond them are written down, as each costs every rank its
# import time again (selfcheck/preload.py should have them).
MODULES_AT_FORK: frozenset | None = None
# Per-rank values that reveal which variable a script passed where (rank or local_rank...)
WATCHED_LOCALS = ("rank", "local_rank", "world_size", "dp_rank", "dp_size", "stage_index",
                  "num_stages")


class Probe:
    def __init__(self, script: str, args: list[str]):
        self.script = os.path.abspath(script)
        self.args = [a for a in args if a != "--eval-probe"]
        self.eval_probe = "--eval-probe" in args
        self.rank = int(os.environ.get("RANK", 0))
        self.dump_dir = Path(os.environ["CHECK_DUMP_DIR"])
        self.record = {
            "rank": self.rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "world_size": int(os.environ.get("WORLD_SIZE", 1)), "error": None,
            "datasets": [], "samplers": [], "loaders": [], "set_epoch": [], "calls": [],
            "prints": [], "saves": [], "evals": [], "logged": [], "tokens": [], "adamw": [],
            "compiled": [], "synchronize": 0, "meshes": [], "ddp": [], "setup": [],
            "load_corpus": [], "stages": [], "schedule_calls": [], "loads": [],
            "forward_dtypes": [], "autocast_forward": [], "compile_calls": [],
        }
        self.datasets, self.samplers, self.models, self.optimizers = [], [], [], []
        self.ddp_models = []  # weak references: whether the script let its DDP model go
        self.on_print = None  # the stand-in GPU's timeline takes the printed lines too
        self.autocasts_open = 0  # autocast contexts (the course's or torch's) entered, not left
        self.evaluating = 0  # inside a pipeline schedule's eval()
        # a training schedule.step since the last optimizer step: its backward passes filled
        # .grad (they run through torch.autograd, not Tensor.backward)
        self.schedule_stepped = False

    # ------------------------------------------------------------------ where a call came from
    def script_line(self, depth: int = 2) -> tuple[str, int] | None:
        """(function, line) of the innermost frame of the participant's script on the stack."""
        frame = sys._getframe(depth)
        while frame is not None:
            if frame.f_code.co_filename == self.script:
                return frame.f_code.co_name, frame.f_lineno
            frame = frame.f_back
        return None

    def script_locals(self, depth: int = 2, names=WATCHED_LOCALS) -> dict:
        """{name: value} of the whole-number local variables `names` of the script's innermost
        frame on the stack. Read without keeping the others alive: before Python 3.13 reading
        f_locals fills a dict that holds every local of the frame until the frame ends (a model
        the script deletes would outlive its `del`), so the dict is emptied again."""
        frame = sys._getframe(depth)
        while frame is not None and frame.f_code.co_filename != self.script:
            frame = frame.f_back
        if frame is None:
            return {}
        snapshot = frame.f_locals
        found = {k: snapshot[k] for k in names
                 if isinstance(snapshot.get(k), int) and not isinstance(snapshot[k], bool)}
        if isinstance(snapshot, dict):
            snapshot.clear()  # (a cache: the variables themselves stay)
        return found

    def script_groups(self, depth: int = 2) -> dict:
        """{name: ranks} of the process groups the script holds in local variables (dp_group:
        which ranks it really reduces over)."""
        import torch.distributed as dist
        frame = sys._getframe(depth)
        while frame is not None and frame.f_code.co_filename != self.script:
            frame = frame.f_back
        if frame is None or not dist.is_initialized():
            return {}
        found = {}
        for k, v in frame.f_locals.items():
            if isinstance(v, dist.ProcessGroup):
                try:
                    found[k] = dist.get_process_group_ranks(v)
                except Exception:  # noqa: BLE001 - a group this rank is not in
                    pass
        return found

    def note_call(self, name: str, **extra) -> None:
        where = self.script_line(3)
        direct = sys._getframe(3).f_code.co_filename == self.script  # not via a helper
        self.record["calls"].append({"name": name, "func": where[0] if where else None,
                                     "line": where[1] if where else None, "direct": direct,
                                     "step": len(self.record["tokens"]), **extra})

    # ------------------------------------------------------------------------------ the hooks
    def install(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        import model.transformer as mt
        import utils.checkpointing as ck
        import utils.data as ud
        import utils.distributed_utils as du
        import utils.checks as uc
        import utils.metrics as um
        probe, record = self, self.record

        def exit_through_the_probe(status: int) -> None:
            raise SystemExit(status)  # run() records the stop, then exits without teardown too
        uc._exit_without_teardown = exit_through_the_probe

        def wrap(owner, name, before=None, after=None):
            original = getattr(owner, name)

            @functools.wraps(original)
            def wrapper(*a, **k):
                if before:
                    before(*a, **k)
                result = original(*a, **k)
                if after:
                    after(result, *a, **k)
                return result
            setattr(owner, name, wrapper)
            return original

        # -- the options: flags the check passes but the script may not have yet (an option a
        # later TODO adds) are dropped instead of failing, and recorded as missing
        import argparse
        optional = dict(f.split("=") for f in os.environ.get("CHECK_OPTIONAL_FLAGS", "")
                        .split(",") if f)
        fallbacks = dict(f.split("=") for f in os.environ.get("CHECK_FLAG_FALLBACKS", "")
                         .split(",") if f)
        parse_args = argparse.ArgumentParser.parse_args

        def parse_args_(parser, args=None, namespace=None):
            argv = list(sys.argv[1:] if args is None else args)
            known = {s for a in parser._actions for s in a.option_strings}
            missing = []
            for flag, n in optional.items():
                if flag in argv and flag not in known:
                    i = argv.index(flag)
                    del argv[i:i + 1 + int(n)]
                    missing.append(flag)
            # a value the check gives that the script's choices leave out: the fallback
            # instead (the script may offer fewer modes than torch.compile has)
            substituted = {}
            for flag, value in fallbacks.items():
                action = next((a for a in parser._actions if flag in a.option_strings), None)
                i = argv.index(flag) if flag in argv else -1
                if action and action.choices and 0 <= i < len(argv) - 1 \
                        and argv[i + 1] not in action.choices and value in action.choices:
                    argv[i + 1] = substituted[flag] = value
            ns = parse_args(parser, argv, namespace)
            simple = (int, float, str, bool, type(None))
            record["parser"] = {"missing": missing, "substituted": substituted,
                                "options": sorted(known), "values": {
                k: v for k, v in vars(ns).items() if isinstance(v, simple)},
                "defaults": {a.dest: a.default for a in parser._actions
                             if a.option_strings and isinstance(a.default, simple)}}
            return ns
        argparse.ArgumentParser.parse_args = parse_args_

        # -- data: which samples each rank read, in which pass
        init, getitem = ud.TokenWindows.__init__, ud.TokenWindows.__getitem__

        def windows_init(self, *a, **k):
            init(self, *a, **k)
            self._check = {"len": len(self), "passes": []}
            probe.datasets.append(self)

        def windows_getitem(self, i):
            if self._check["passes"] and not self._check.get("off"):
                self._check["passes"][-1].append(int(i))
            return getitem(self, i)

        ud.TokenWindows.__init__, ud.TokenWindows.__getitem__ = windows_init, windows_getitem

        def dataset_index(ds):
            return next((i for i, d in enumerate(probe.datasets) if d is ds), None)

        def sampler_init(kind):
            def before(self, dataset, *a, **k):
                names = ("num_replicas", "rank", "shuffle", "seed", "drop_last")
                given = dict(zip(names, a, strict=False))
                given.update({n: k[n] for n in names if n in k})
                where = probe.script_line(3)
                record["samplers"].append({
                    "kind": kind, "dataset": dataset_index(dataset),
                    "given": {n: v for n, v in given.items() if isinstance(v, (int, bool))},
                    "line": where[1] if where else None, "locals": probe.script_locals(3),
                    "groups": probe.script_groups(3)})
                probe.samplers.append(self)
            return before

        wrap(DistributedSampler, "__init__", before=sampler_init("DistributedSampler"))
        wrap(ud.DistributedEvalSampler, "__init__",
             before=sampler_init("DistributedEvalSampler"))

        def set_epoch(self, epoch):
            index = next((i for i, s in enumerate(probe.samplers) if s is self), None)
            record["set_epoch"].append([index, int(epoch)])
        wrap(DistributedSampler, "set_epoch", before=set_epoch)

        def loader_iter(self):
            if hasattr(self.dataset, "_check"):
                self.dataset._check["passes"].append([])
            if dataset_index(self.dataset) == 0:  # a training epoch's batches begin
                record.setdefault("train_passes_t", []).append(time.perf_counter())
        wrap(DataLoader, "__iter__", before=loader_iter)

        def loader_init(self, dataset, *a, **k):
            sampler = k.get("sampler")
            index = next((i for i, s in enumerate(probe.samplers) if s is sampler), None)
            where = probe.script_line(3)
            record["loaders"].append({
                "dataset": dataset_index(dataset), "sampler": index,
                "sampler_type": type(sampler).__name__ if sampler is not None else None,
                "shuffle": bool(k.get("shuffle")), "batch_size": k.get("batch_size", a[0] if a else 1),
                "drop_last": bool(k.get("drop_last")), "line": where[1] if where else None})
        wrap(DataLoader, "__init__", before=loader_init)

        def load_corpus(*a, **k):
            warn = k.get("warn")
            record["load_corpus"].append({"warn": getattr(warn, "__name__", repr(warn))})
        wrap(ud, "load_corpus_or_exit", before=load_corpus)

        # -- the model: every TransformerLM built, and what its linear layers compute in
        model_init = mt.TransformerLM.__init__

        def model_init_(self, *a, **k):
            model_init(self, *a, **k)
            probe.models.append(self)
            if len(probe.models) == 1:
                record["model_vocab"] = self.cfg.vocab_size  # (known also if the run crashes)
                record["model_flops"] = model_flops(self, flops_of)  # what MFU counts (TODO 42)
                # its initial weights, a sum per tensor: the pipeline's ranks must all build
                # the same model to cut their stages from
                with torch.no_grad():  # (a model on the meta device has no values)
                    record["initial_weights"] = [float(p.double().sum()) for p in
                                                 self.parameters() if not p.is_meta]
                self.register_forward_pre_hook(probe.forward_pre_hook)
                self.register_forward_hook(probe.output_hook)
                for module in self.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.register_forward_hook(probe.linear_hook)
        mt.TransformerLM.__init__ = model_init_

        def ddp_init(self, module, *a, **k):
            probe.ddp_models.append(weakref.ref(self))
            device_ids = k.get("device_ids", a[0] if a else None)
            where = probe.script_line(3)
            record["ddp"].append({"device_ids": list(device_ids) if device_ids else None,
                                  "module": type(module).__name__,
                                  "line": where[1] if where else None})
        def ddp_count_allreduces(result, self, *a, **k):
            # the memory step: DDP's gradient all-reduces, one per bucket and synchronised
            # backward (only where asked: a Python hook is a little slower than DDP's own)
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            record["allreduces"] = 0

            def counting(state, bucket):
                record["allreduces"] += 1
                return default_hooks.allreduce_hook(state, bucket)
            self.register_comm_hook(self.process_group, counting)
        wrap(DistributedDataParallel, "__init__", before=ddp_init,
             after=ddp_count_allreduces if os.environ.get("CHECK_COUNT_ALLREDUCES") else None)
        if os.environ.get("CHECK_COUNT_ALLREDUCES"):  # FSDP's gradient reduce-scatters too
            def reduce_scattered(*a, **k):
                record["reduce_scatters"] = record.get("reduce_scatters", 0) + 1
            for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
                if hasattr(dist, name):
                    wrap(dist, name, before=reduce_scattered)

        # -- the course's helpers and the collectives: who called them, from which line
        def called(name, **extra_of):
            def before(*a, **k):
                extra = {key: f(*a, **k) for key, f in extra_of.items()}
                probe.note_call(name, **extra)
            return before

        def group_size(*a, _at=1, **k):
            """The size of the group a reduction runs over (the argument at `_at`)."""
            group = k.get("group", a[_at] if len(a) > _at else None)
            try:
                return dist.get_world_size(group) if dist.is_initialized() else 1
            except Exception:  # noqa: BLE001 - a group this rank is not in
                return None

        for name in ("all_reduce_mean", "all_reduce_sum"):
            wrap(du, name, before=called(name, group_size=group_size))
        for name in ("print0", "save0", "barrier", "gather_per_rank"):
            wrap(du, name, before=called(name))
        for name in ("save_full_model", "load_sharded_model"):
            wrap(ck, name, before=called(name))
        # the folder where --resume auto and a restart look for the newest checkpoint
        wrap(ck, "resume_checkpoint", before=called("resume_checkpoint", folder=lambda *a, **k: str(
            k.get("folder", a[1] if len(a) > 1 else ""))))

        def saved(key):  # a number of the train_state a checkpoint is saved with
            def get(*a, **k):
                state = k.get("train_state", a[3] if len(a) > 3 else None)
                value = state.get(key) if isinstance(state, dict) else None
                return value if isinstance(value, (int, float)) else None
            return get
        wrap(ck, "save_sharded_model", before=called(
            "save_sharded_model", state_step=saved("step"), state_epoch=saved("epoch"),
            state_batches=saved("batches_done"),
            path=lambda *a, **k: str(k.get("path", a[2] if len(a) > 2 else "")),
            optimizer_steps=lambda *a, **k: record.get("optimizer_calls", {}).get("steps")))

        def batches_per_epoch(*a, **k):  # samples or batches? (a resume at an epoch's end)
            return k.get("batches_per_epoch", a[2] if len(a) > 2 else None)
        wrap(ck, "resume_position", before=called("resume_position",
                                                  batches_per_epoch=batches_per_epoch))

        def destroying(name):  # the model's last state, while its meshes' groups still exist
            def before(*a, **k):
                probe.note_call(name)
                record.setdefault("destroyed_at", time.perf_counter())  # (print0 after it)
                probe.snapshot()
                if probe.ddp_models and "ddp_alive_at_destroy" not in record:
                    gc.collect()  # what the course's helper does first: cycles go too
                    record["ddp_alive_at_destroy"] = any(r() is not None
                                                         for r in probe.ddp_models)
            return before
        wrap(du, "destroy_process_group", before=destroying("destroy_process_group"))

        def precision_asked(*a, **k):  # the dtype MFU divides by (TODO 42)
            return str(k.get("precision", a[1] if len(a) > 1 else "fp32"))
        wrap(um, "peak_flops", before=called("peak_flops", precision=precision_asked))

        def params_counted(*a, **k):  # the parameters MFU's FLOPs per token count (TODO 42)
            n = k.get("n_params_non_embedding", a[0] if a else None)
            return n if isinstance(n, (int, float)) and not isinstance(n, bool) else None
        flops_of = wrap(um, "flops_per_token",
                        before=called("flops_per_token", n_params=params_counted))

        def setup_after(result, *a, **k):
            record["setup"][-1]["returned"] = [r if isinstance(r, int) else str(r)
                                               for r in result]
        wrap(du, "setup", before=lambda *a, **k: record["setup"].append({}), after=setup_after)

        def broadcast_src(*a, **k):
            return k.get("src", a[1] if len(a) > 1 else None)

        def reduce_op(*a, **k):
            return str(k.get("op", a[1] if len(a) > 1 else "SUM"))

        wrap(dist, "all_reduce", before=called("dist.all_reduce",  # (tensor, op, group)
                                               group_size=functools.partial(group_size, _at=2),
                                               op=reduce_op))
        wrap(dist, "broadcast", before=called("dist.broadcast", src=broadcast_src))
        wrap(dist, "destroy_process_group", before=destroying("dist.destroy_process_group"))

        import torch.distributed.checkpoint as dcp

        def dcp_save_before(*a, **k):
            probe.note_call("dcp.save", path=str(k.get("checkpoint_id", a[1] if len(a) > 1
                                                         else "")))
        wrap(dcp, "save", before=dcp_save_before)
        wrap(dcp, "load", before=called("dcp.load"))

        def loaded(result, *a, **k):
            if isinstance(result, dict):
                record["loads"].append({k: v for k, v in result.items() if k != "loss_history"}
                                       | {"loss_history_len": len(result.get("loss_history", []))})
        wrap(ck, "load_sharded_model", after=loaded)

        # -- files written with torch.save (a state dict of weights: a model save)
        def torch_save(obj, f, *a, **k):
            if isinstance(obj, dict) and any("weight" in str(key) for key in obj):
                where = probe.script_line(3)
                record["saves"].append({"path": saved_path(f), "line": where[1] if where else None,
                                        "t": time.perf_counter()})
        wrap(torch, "save", before=torch_save)

        # -- device meshes (the dims the script asked for), pipeline stages and schedules
        import torch.distributed.device_mesh as dm

        def mesh_after(mesh, *a, **k):
            record["meshes"].append({
                "device_type": a[0] if a else k.get("device_type"),
                "shape": list(mesh.mesh.shape), "names": list(mesh.mesh_dim_names or []),
                "coords": list(mesh.get_coordinate() or [])})
        # the same function under every public name it has (torch.distributed.tensor bound it
        # when it was imported, before the probe), and a DeviceMesh the script builds itself
        made = wrap(dm, "init_device_mesh", after=mesh_after)
        wrapped = dm.init_device_mesh
        for owner in ("torch.distributed", "torch.distributed.tensor",
                      "torch.distributed.tensor.device_mesh"):
            if getattr(sys.modules.get(owner), "init_device_mesh", None) is made:
                sys.modules[owner].init_device_mesh = wrapped
        mesh_init = dm.DeviceMesh.__init__

        @functools.wraps(mesh_init)
        def mesh_init_(mesh, *a, **k):
            mesh_init(mesh, *a, **k)
            if sys._getframe(1).f_code.co_filename == probe.script:  # (not torch's own)
                mesh_after(mesh, *a, **k)
        dm.DeviceMesh.__init__ = mesh_init_
        import torch.distributed.tensor.parallel as tpar

        def plan_layouts(*a, **k):
            """{submodule: its style and the layouts it expects its input in} of a TP plan."""
            plan = k.get("parallelize_plan", a[2] if len(a) > 2 else None)
            if not isinstance(plan, dict):
                return {}
            return {str(name): {"style": type(s).__name__, "input_layouts": [
                str(x) for x in (getattr(s, "input_layouts", None) or ()) if x is not None]}
                for name, s in plan.items()}
        wrap(tpar, "parallelize_module", before=called("parallelize_module", plan=plan_layouts))
        wrap(tpar, "loss_parallel", before=called("loss_parallel"))
        import torch.distributed.pipelining as pl

        def stage_init(self, submodule, stage_index, num_stages, *a, **k):
            self._check_built = len(record["stages"])  # which one a schedule runs on
            record["stages"].append({"stage_index": int(stage_index),
                                     "num_stages": int(num_stages),
                                     # the module it wraps: the evaluation's stage wraps the
                                     # training model itself, not a copy of its first weights
                                     "module": id(submodule)})
        wrap(pl.PipelineStage, "__init__", before=stage_init)
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        def schedule_init(self, stage, n_microbatches=None, loss_fn=None, *a, **k):
            frame = sys._getframe(2)  # the file that built it (the script, or the course's
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back  # drawing of the schedule in theory)
            self._check_by_course = (frame is not None and frame.f_code.co_filename !=
                                     probe.script and f"{os.sep}utils{os.sep}" in
                                     frame.f_code.co_filename)
            self._check_schedule = len(record.setdefault("schedules", []))  # which one is called
            record["schedules"].append({
                "kind": type(self).__name__, "microbatches": n_microbatches,
                "loss_fn": getattr(loss_fn, "__name__", None) if loss_fn else None,
                "stage": getattr(stage, "_check_built", None),
                "by_course": self._check_by_course})
        wrap(PipelineScheduleSingle, "__init__", before=schedule_init)

        def schedule_call(kind):
            def before(self, *a, target=None, losses=None, **k):
                stage = getattr(self, "_stage", None)
                if kind == "step" and not probe.evaluating and not getattr(
                        self, "_check_by_course", False):
                    probe.schedule_stepped = True
                if len(record["schedule_calls"]) < 50:
                    record["schedule_calls"].append({
                        "kind": kind, "args": len(a), "target": target is not None,
                        "losses": losses is not None, "is_first": bool(getattr(stage, "is_first", False)),
                        "is_last": bool(getattr(stage, "is_last", False)),
                        "has_loss_fn": getattr(self, "_loss_fn", None) is not None,
                        # evaluation under another autocast than training sends other dtypes
                        # (a GPU in bf16 stops); a stage left in eval mode trains without dropout
                        "autocast": probe.autocast_state(getattr(stage, "device", None)),
                        "training": bool(getattr(getattr(stage, "submod", None), "training",
                                                 True)),
                        "by_course": getattr(self, "_check_by_course", False),
                        "schedule": getattr(self, "_check_schedule", None),
                        "inside_eval": kind == "step" and probe.evaluating > 0,
                        # a padded batch's rows and its targets that count nowhere
                        "targets": [int(target.shape[0]), int((target == ud.IGNORE_INDEX).sum())]
                        if isinstance(target, torch.Tensor) and target.dim() else None})
            return before
        wrap(PipelineScheduleSingle, "step", before=schedule_call("step"))
        if hasattr(PipelineScheduleSingle, "eval"):  # (torch's eval calls step)
            record_eval = schedule_call("eval")

            def eval_before(*a, **k):
                record_eval(*a, **k)
                probe.evaluating += 1

            def eval_after(*a, **k):
                probe.evaluating -= 1
            wrap(PipelineScheduleSingle, "eval", before=eval_before, after=eval_after)

        # -- autocast contexts open: the course's autocast("fp32") enters nothing of torch's, so
        # at fp32 only the context written around a call tells training and evaluation apart
        import utils.precision as uprec
        course_autocast = uprec.autocast

        @functools.wraps(course_autocast)
        def autocast_(*a, **k):
            return OpenAutocast(probe, course_autocast(*a, **k))
        uprec.autocast = autocast_
        torch_autocast = torch.amp.autocast_mode.autocast
        enter, exit_ = torch_autocast.__enter__, torch_autocast.__exit__

        def autocast_enter(self):
            probe.autocasts_open += 1
            return enter(self)

        def autocast_exit(self, *a):
            probe.autocasts_open -= 1
            return exit_(self, *a)
        torch_autocast.__enter__, torch_autocast.__exit__ = autocast_enter, autocast_exit

        # -- the course's monitor: the log lines it writes (not the script's own reports)
        import utils.monitor as umon

        def monitor_line(result, *a, **k):
            if len(record.setdefault("monitor_lines", [])) < 500:
                record["monitor_lines"].append(str(result))
        wrap(umon.TrainingMonitor, "report", after=monitor_line)

        # -- metrics: what the script logs, the tokens it counts, the clocks it reads
        def logged(self, metrics, step):
            record["logged"].append({"step": int(step), "metrics": {
                k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))
                or hasattr(v, "item")}})
        wrap(um.MetricLogger, "log", before=logged)

        def tokens(self, n):
            if not record["tokens"]:  # what the script counted before training (TP's TODO 28)
                record["step_locals"] = probe.script_locals(names=("local_params",))
            record["tokens"].append(int(n))
        wrap(um.Throughput, "step", before=tokens)

        sync = um.synchronize

        @functools.wraps(sync)
        def synchronize_(device):  # the calls of the script itself, not of the helpers
            if sys._getframe(1).f_code.co_filename == probe.script:
                record["synchronize"] += 1
            return sync(device)
        um.synchronize = synchronize_

        # -- the performance step: profilers started, and their operator table (printed?)
        import torch.profiler as tprof

        def profiler_started(*a, **k):
            record["profilers_started"] = record.get("profilers_started", 0) + 1
        wrap(tprof.profiler.profile, "start", before=profiler_started)

        def profiler_stepped(*a, **k):  # (more steps than training steps: stepped twice)
            record["profiler_steps"] = record.get("profiler_steps", 0) + 1
        wrap(tprof.profiler.profile, "step", before=profiler_stepped)

        from torch.autograd.profiler_util import EventList

        def table_after(result, self, *a, **k):
            record.setdefault("tables", []).append({
                "sort_by": k.get("sort_by"), "first_line": next(
                    (l for l in str(result).splitlines() if l.strip()), "")})
        wrap(EventList, "table", after=table_after)

        # -- every optimizer the script builds: its class and what it runs with (the memory
        # step's ZeroRedundancyOptimizer: its optimizer_class, and its local optimizer's)
        def optimizer_built(result, self, *a, **k):
            groups = getattr(getattr(self, "optim", None), "param_groups", None) or \
                self.param_groups
            if len(record.setdefault("optimizers", [])) < 10:
                record["optimizers"].append({
                    "class": type(self).__name__,
                    "optimizer_class": getattr(getattr(self, "_optim_constructor", None) or k.get(
                        "optimizer_class", a[1] if len(a) > 1 else None), "__name__", None),
                    "lr": groups[0].get("lr") if groups else None,
                    "weight_decay": groups[0].get("weight_decay") if groups else None,
                    "line": (probe.script_line(3) or (None, None))[1]})
        from torch.distributed.optim import ZeroRedundancyOptimizer
        wrap(ZeroRedundancyOptimizer, "__init__", after=optimizer_built)
        wrap(torch.optim.AdamW, "__init__", after=optimizer_built)

        # -- optimizer.step() and zero_grad() against backward(): a step per micro-batch, or a
        # zero_grad() that throws away the gradients of earlier micro-batches (the memory step's
        # accumulation). ZeroRedundancyOptimizer's step runs its AdamW's: counted once.
        counted = record["optimizer_calls"] = {"steps": 0, "discarding_zero_grads": 0,
                                               "steps_on_old_grads": 0}
        since = {"backwards": 0, "depth": 0, "since_step": 0, "zeroed": False}

        def step_pre(optimizer, *a):
            since["depth"] += 1
            if since["depth"] == 1:
                # a step after the first without zero_grad() since the one before: its gradients
                # hold the earlier step's too
                if counted["steps"] and not since["zeroed"] and since["since_step"]:
                    counted["steps_on_old_grads"] += 1
                since["zeroed"] = False
                counted["steps"] += 1
                since["backwards"] = 0
                # backward() calls since the last step, zero_grad() or not: the micro-batches
                # this step was counted after (the first 20 steps)
                if len(counted.setdefault("backwards_per_step", [])) < 20:
                    counted["backwards_per_step"].append(since["since_step"])
                since["since_step"] = 0
                probe.schedule_stepped = False

        def step_post(optimizer, *a):
            since["depth"] -= 1

        def backward_(*a, **k):
            since["backwards"] += 1
            since["since_step"] += 1
            # a DDP model's sync off during backward (no_sync() entered, or the flag set)
            if any(m() is not None and not getattr(m(), "require_backward_grad_sync", True)
                   for m in probe.ddp_models):
                counted["ddp_unsynced_backwards"] = counted.get("ddp_unsynced_backwards", 0) + 1

        def zero_grad_(self, *a, **k):
            counted["zero_grads"] = counted.get("zero_grads", 0) + 1  # (the pipeline: any at all)
            since["zeroed"] = True
            if since["backwards"] and not since["depth"]:
                counted["discarding_zero_grads"] += 1
            if probe.schedule_stepped and not since["depth"]:  # between schedule.step and
                counted["zero_grads_after_schedule"] = counted.get(  # optimizer.step
                    "zero_grads_after_schedule", 0) + 1
            since["backwards"] = 0
            probe.schedule_stepped = False
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        register_optimizer_step_pre_hook(step_pre)
        register_optimizer_step_post_hook(step_post)
        wrap(torch.Tensor, "backward", before=backward_)
        wrap(torch.optim.Optimizer, "zero_grad", before=zero_grad_)

        def module_zero_grad(*a, **k):  # model.zero_grad() clears the gradients as well
            counted["zero_grads"] = counted.get("zero_grads", 0) + 1
            since["zeroed"] = True
        wrap(torch.nn.Module, "zero_grad", before=module_zero_grad)

        # -- the performance step: what AdamW and torch.compile were asked for
        def adamw_init(self, *a, **k):
            record["adamw"].append(sorted(k))
            probe.optimizers.append(self)
        wrap(torch.optim.AdamW, "__init__", before=adamw_init)

        def compile_(model=None, *a, **k):  # recorded, not run: compiling takes minutes
            if model is None:  # @torch.compile(mode=...) as a decorator: compiles what follows
                return lambda fn: compile_(fn, *a, **k)
            record["compiled"].append(type(model).__name__)
            module = isinstance(model, torch.nn.Module)
            name = type(model).__name__ if module else getattr(model, "__name__",
                                                               type(model).__name__)
            record["compile_calls"].append({  # a module by its class, a function by its name
                "what": name, "module": module, "mode": k.get("mode"), "in_place": False})
            if module or not callable(model):
                return model

            @functools.wraps(model)
            def counted(*args, **kwargs):  # a compiled function: is it used, for a loss?
                calls = record.setdefault("compiled_function_calls", {})
                calls[name] = calls.get(name, 0) + 1
                result = model(*args, **kwargs)
                if isinstance(result, torch.Tensor) and result.dim() == 0:
                    losses = record.setdefault("compiled_losses", [])
                    if name not in losses:
                        losses.append(name)
                return result
            return counted
        torch.compile = compile_

        def module_compile(self, *a, **k):
            record["compiled"].append(type(self).__name__)
            record["compile_calls"].append({"what": type(self).__name__, "module": True,
                                            "mode": k.get("mode"), "in_place": True})
        torch.nn.Module.compile = module_compile

        # -- everything printed, with the line of the script that caused it
        original_print = builtins.print

        @functools.wraps(original_print)
        def print_(*a, **k):
            if k.get("file") in (None, sys.stdout, sys.stderr) and len(record["prints"]) < 2000:
                caller = sys._getframe(1)
                where = probe.script_line(2)
                text = k.get("sep", " ").join(str(x) for x in a)
                record["prints"].append({
                    "text": text[:300], "line": where[1] if where else None,
                    "t": time.perf_counter(),
                    "by": f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_code.co_name}"})
                if probe.on_print is not None and where:
                    probe.on_print(text, where[1])
            return original_print(*a, **k)
        builtins.print = print_

        # -- a stand-in GPU, where the check asks for one (selfcheck/standin.py)
        from selfcheck import standin
        if standin.active():
            standin.install(probe)

    def autocast_state(self, device) -> list:
        """[an autocast context open, the dtype torch's autocast computes in or None]."""
        import torch
        kind = getattr(device, "type", None) or "cpu"
        try:
            dtype = (str(torch.get_autocast_dtype(kind)).replace("torch.", "")
                     if torch.is_autocast_enabled(kind) else None)
        except (RuntimeError, TypeError):  # a device type autocast does not know
            dtype = None
        return [self.autocasts_open > 0, dtype]

    def output_hook(self, module, inputs, output):
        """What the model returns: a DTensor (logits split over the vocabulary) or a tensor."""
        if len(self.record.setdefault("outputs", [])) < 3:
            self.record["outputs"].append({
                "type": type(output).__name__, "shape": list(output.shape),
                "local_shape": list(output.to_local().shape) if hasattr(output, "to_local")
                else list(output.shape), "vocab": module.cfg.vocab_size
                if hasattr(module, "cfg") else None,
                "placements": [str(p) for p in getattr(output, "placements", ())]})

    def forward_pre_hook(self, module, inputs):
        import torch
        device = next((x.device.type for x in inputs if hasattr(x, "device")), "cpu")
        if len(self.record["autocast_forward"]) < 20:
            self.record["autocast_forward"].append(bool(torch.is_autocast_enabled(device)))
        if not torch.is_grad_enabled() and torch.is_autocast_enabled(device):
            # an evaluation under autocast (the course evaluates in fp32)
            self.record["autocast_no_grad"] = self.record.get("autocast_no_grad", 0) + 1

    def linear_hook(self, module, inputs, output):
        if len(self.record["forward_dtypes"]) < 20 and hasattr(output, "dtype"):
            self.record["forward_dtypes"].append(str(output.dtype).replace("torch.", ""))

    # ------------------------------------------------------------------------------- the run
    def run(self) -> None:
        stack_file = open(self.dump_dir / f"rank{self.rank}.stack", "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
        faulthandler.enable(file=stack_file, all_threads=True)  # and where a fatal signal hit
        self.install()
        import torch.distributed as dist
        spec = importlib.util.spec_from_file_location("participant_script", self.script)
        module = importlib.util.module_from_spec(spec)
        sys.argv = [self.script, *self.args]
        record = self.record
        try:
            spec.loader.exec_module(module)
            if self.eval_probe and hasattr(module, "evaluate"):
                self.wrap_evaluate(module)
            self.watch_functions(module)
            collectives_lesson(self, module)  # train/collectives.py only: the block at the end
            performance_lesson(self, module)  # train/perf_training.py only
            module.main()
        except SystemExit as e:
            if e.code not in (0, None):
                record["error"] = self.describe(e, exit_message=e.code)
                if not isinstance(e.code, int):  # what Python prints when a script exits so
                    print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 - reported to the participant
            record["error"] = self.describe(e)
            traceback.print_exc()
        record["globals"] = module_globals(module)
        record["group_alive"] = dist.is_initialized()
        self.snapshot()
        record["datasets"] = [d._check for d in self.datasets]
        if MODULES_AT_FORK is not None:
            record["torch_imported_after_fork"] = sorted(
                m for m in set(sys.modules) - MODULES_AT_FORK if m.split(".")[0] == "torch")
            record["gc_frozen_objects"] = gc.get_freeze_count()  # preload.py's gc.freeze()
        (self.dump_dir / f"rank{self.rank}.json").write_text(json.dumps(record, default=str))
        if record["error"]:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # no teardown that could hang on a broken process group

    def describe(self, e: BaseException, exit_message=None) -> dict:
        frames = [{"file": f.filename, "line": f.lineno, "func": f.name, "text": f.line or ""}
                  for f in traceback.extract_tb(e.__traceback__)]
        if exit_message is not None and not isinstance(exit_message, int):
            message = str(exit_message)
        elif exit_message is not None:
            message = ""
        else:
            message = f"{type(e).__name__}: {e}"
            wrapped = " ".join(str(e).split())
            if e.__cause__ is not None and "failed to run" in wrapped:
                # a pipeline stage wraps the error of the model's code: that one says what
                stage = wrapped.split(" args:")[0].rstrip(":")
                message = f"{type(e.__cause__).__name__}: {e.__cause__} ({stage})"
        return {"type": type(e).__name__, "message": message.strip()[:600],
                "exit": exit_message is not None, "frames": frames[-40:]}

    def watch_functions(self, module) -> None:
        """Record the arguments the script passes to its own functions of the lessons."""
        record = self.record.setdefault("own_calls", {})
        self.record["defined"] = [n for n in WATCHED_FUNCTIONS if callable(getattr(module, n, None))]
        for name in WATCHED_FUNCTIONS:
            original = getattr(module, name, None)
            if not callable(original):
                continue

            def wrapper(*a, _name=name, _original=original, **k):
                calls = record.setdefault(_name, [])
                entry = {"args": [short(x) for x in a],
                         "kwargs": {key: short(v) for key, v in k.items()}}
                if len(calls) < 5:
                    calls.append(entry)
                if _name == "apply_tp":  # what the caller counted before the split (TODO 28)
                    entry["locals_before"] = self.script_locals(names=("local_params",))
                result = _original(*a, **k)
                entry["returned"] = True
                if result is None:  # (a function without its `return model`)
                    entry["none"] = True
                if _name == "apply_tp" and hasattr(result, "named_parameters"):
                    try:  # the split as the plan left it: a later fully_shard that fails midway
                        entry["plan"] = describe_tp(result)  # changes parameters too
                    except Exception:  # noqa: BLE001 - the end-of-run description remains
                        pass
                return result
            setattr(module, name, functools.wraps(original)(wrapper))

    def wrap_evaluate(self, module) -> None:
        original = module.evaluate
        probe = self

        def evaluate(model, loader, device, *rest, **kw):
            value = original(model, loader, device, *rest, **kw)
            entry = {"value": value, "resharded": probe.all_dtensor(model)}
            entry["full"] = probe.full_eval(model, loader.dataset, device)
            probe.record["evals"].append(entry)
            return value
        module.evaluate = evaluate

    # ------------------------------------------------------------------ the model at the end
    @staticmethod
    def all_dtensor(model) -> bool:
        from torch.distributed.tensor import DTensor
        return all(isinstance(p, DTensor) for p in model.parameters())

    @staticmethod
    def full_eval(model, dataset, device) -> float:
        """The whole split in this process (a collective under FSDP: every rank runs it)."""
        import torch
        import torch.nn.functional as F

        import utils.data as ud
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float64)
            count = 0
            was = model.training
            model.eval()
            dataset._check["off"] = True
            for i in range(0, len(dataset), 8):
                xs, ys = zip(*(dataset[j] for j in range(i, min(i + 8, len(dataset)))), strict=True)
                x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
                logits = model(x)
                if hasattr(logits, "full_tensor"):
                    logits = logits.full_tensor()
                total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum",
                                         ignore_index=ud.IGNORE_INDEX).double().cpu()
                count += (y != ud.IGNORE_INDEX).sum().item()
            model.train(was)
            dataset._check["off"] = False
            for unit in model.modules():  # as it found them: every FSDP unit sharded
                if hasattr(unit, "reshard"):
                    unit.reshard()
        return (total / count).item()

    def snapshot(self) -> None:
        """Describe the model (once: at teardown, or at the end after a failure)."""
        if self.record.get("described"):
            return
        self.record["described"] = True
        try:
            self.describe_models()
        except Exception as e:  # noqa: BLE001 - the record must be written whatever happened
            self.record["describe_error"] = f"{type(e).__name__}: {e}"[:300]

    def describe_models(self) -> None:
        record = self.record
        if not self.models:
            return
        m = self.models[0]
        record["param_sum"] = float(sum(
            (p.to_local() if hasattr(p, "to_local") else p).detach().double().sum()
            for p in m.parameters()))
        record["param_dtypes"] = sorted({str(p.dtype).replace("torch.", "")
                                         for p in m.parameters()})
        if self.optimizers:  # an optimizer made before the model was sharded holds old tensors
            mine = {id(p) for p in m.parameters()}
            held = [id(p) for g in self.optimizers[-1].param_groups for p in g["params"]]
            record["optimizer_holds_model"] = bool(held) and all(i in mine for i in held)
        record["fsdp"] = describe_fsdp(m)
        record["tp"] = describe_tp(m)
        record["meshes_used"] = describe_meshes(m)
        record["layers"] = sorted(int(k) for k in m.layers)
        record["block_types"] = [type(b).__name__ for b in m.layers.values()]
        # checkpoint_wrapper's checkpoint_impl (the memory step: the reentrant one keeps more)
        record["checkpoint_impls"] = sorted({impl.name for b in m.layers.values()
                                             if (impl := getattr(b, "checkpoint_impl", None))
                                             is not None and hasattr(impl, "name")})
        # what each wrapper's checkpoint_fn runs with (a checkpoint_fn of one's own can be
        # reentrant whatever checkpoint_impl says; preserve_rng_state=False changes dropout)
        record["checkpoint_fns"] = [checkpoint_fn_options(b) for b in m.layers.values()
                                    if callable(getattr(b, "checkpoint_fn", None))]
        record["parts"] = {name: getattr(m, name, None) is not None
                           for name in ("tok_emb", "pos_emb", "norm", "output")}


class OpenAutocast:
    """The course's autocast(...) context, counted while it is open (Probe.autocast_state)."""

    def __init__(self, probe, inner):
        self.probe, self.inner = probe, inner

    def __enter__(self):
        self.probe.autocasts_open += 1
        return self.inner.__enter__()

    def __exit__(self, *a):
        self.probe.autocasts_open -= 1
        return self.inner.__exit__(*a)


WATCHED_FUNCTIONS = ("apply_fsdp", "apply_tp", "split_pipeline_stage", "build_schedule",
                     "make_profiler", "profiler_window", "check_tp_degree")


def saved_path(f) -> str:
    """The file torch.save writes: the path, also where utils.files.atomic_torch_save gives it
    the open temporary file (whose name is a file descriptor)."""
    if isinstance(f, (str, os.PathLike)):
        return str(f)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "atomic_torch_save" and "path" in frame.f_locals:
            return str(frame.f_locals["path"])
        frame = frame.f_back
    return str(getattr(f, "name", f))


def short(value):
    """A JSON-able, short description of an argument."""
    if isinstance(value, (bool, int, float, type(None))):
        return value
    if isinstance(value, str):
        return {"str": value[:80]}
    if type(value).__name__ == "DeviceMesh":
        return {"type": "DeviceMesh", "names": list(value.mesh_dim_names or []),
                "shape": list(value.mesh.shape)}
    return {"type": type(value).__name__}


def module_globals(module) -> dict:
    """{name: "module.qualname"} of the classes, functions and modules the script holds."""
    import types
    found = {}
    for name, obj in vars(module).items():
        if isinstance(obj, types.ModuleType):
            found[name] = obj.__name__
        elif isinstance(obj, type) or callable(obj):
            owner, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if owner and qual and owner != "participant_script":
                found[name] = f"{owner}.{qual}"
    return found


def checkpoint_fn_options(wrapper) -> dict:
    """{"reentrant", "preserve_rng_state"} of a checkpoint_wrapper's checkpoint_fn, as they take
    effect: torch.utils.checkpoint.checkpoint without use_reentrant is reentrant (None: another
    function, unknown)."""
    import torch.utils.checkpoint
    fn = wrapper.checkpoint_fn
    keywords = getattr(fn, "keywords", None) or {}
    plain = getattr(fn, "func", fn) is torch.utils.checkpoint.checkpoint
    return {"reentrant": keywords.get("use_reentrant") in (None, True) if plain else None,
            "preserve_rng_state": keywords.get("preserve_rng_state", True)}


def unwrapped(block):
    """The block inside a checkpoint_wrapper (fully_shard may have been given either)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def describe_fsdp(m):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    # a block's unit may be the block inside its checkpoint_wrapper
    layers = [b if isinstance(b, FSDPModule) else unwrapped(b) for b in m.layers.values()]
    # units inside the blocks (their attention or MLP sharded instead of the block)
    inner = [f"layers.{name}" for name, sub in m.layers.named_modules()
             if name and isinstance(sub, FSDPModule) and not any(sub is b for b in layers)]
    if not isinstance(m, FSDPModule) and not any(isinstance(b, FSDPModule) for b in layers) \
            and not inner:
        return None
    plain = [n for n, p in m.named_parameters() if not isinstance(p, DTensor)]

    def unit(module):
        """(reshard_after_forward, offload policy's class) of an FSDP unit, None if unknown."""
        try:  # FSDP's internals: how the unit was sharded (they differ between releases)
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                return None, None
            flag = getattr(group, "_reshard_after_forward",
                           group.post_forward_mesh_info is not None)
            return flag, type(getattr(group, "offload_policy", None)).__name__
        except Exception:  # noqa: BLE001
            return None, None
    def precision(module):
        """[param_dtype, reduce_dtype, output_dtype] of a unit's MixedPrecisionPolicy."""
        try:
            policy = module._get_fsdp_state()._mp_policy
            return [None if d is None else str(d).replace("torch.", "")
                    for d in (policy.param_dtype, policy.reduce_dtype, policy.output_dtype)]
        except Exception:  # noqa: BLE001
            return None
    blocks = [unit(b) if isinstance(b, FSDPModule) else (None, None) for b in layers]
    root = unit(m) if isinstance(m, FSDPModule) else (None, None)
    return {"blocks": [isinstance(b, FSDPModule) for b in layers],
            "root": isinstance(m, FSDPModule), "all_dtensor": not plain, "plain": plain,
            "inner": inner,
            "reshard_after_forward": [flag for flag, _ in blocks],
            "offload": [policy for _, policy in blocks], "root_offload": root[1],
            "root_reshard": root[0],
            "precision": [precision(b) if isinstance(b, FSDPModule) else None
                          for b in layers],
            "root_precision": precision(m) if isinstance(m, FSDPModule) else None}


def describe_tp(m):
    """Which planned TP split every parameter has ("wrong" lists the deviations)."""
    from torch.distributed.tensor import DTensor, Shard
    # column-wise: weight rows and bias split; row-wise: weight columns split, bias whole
    plan = {"attn.q_proj.weight": 0, "attn.k_proj.weight": 0, "attn.v_proj.weight": 0,
            "attn.out_proj.weight": 1, "mlp.in_proj.weight": 0, "mlp.out_proj.weight": 1,
            "attn.q_proj.bias": 0, "attn.k_proj.bias": 0, "attn.v_proj.bias": 0,
            "mlp.in_proj.bias": 0}
    wrong, split = [], 0
    # what each rank holds after the TP split (before FSDP's): a TP-split parameter's share
    local = 0.0
    for p in m.parameters():
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        tp_split = "tp" in names and p.placements[names.index("tp")].is_shard()
        local += p.numel() / (p.device_mesh.size(names.index("tp")) if tp_split else 1)
    for name, p in m.named_parameters():
        key = name.split(".", 2)[-1] if name.startswith("layers.") else name
        dim = plan.get(key, {"tok_emb.weight": 0, "output.weight": 0,
                             "output.bias": 0}.get(name))
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        if dim is None:
            if "tp" in names and any(pl.is_shard() for pl in
                                     [p.placements[names.index("tp")]]):
                wrong.append(f"{name} is split over tp, but it should stay whole")
            continue
        if "tp" not in names:
            wrong.append(f"{name} is not split over the tp mesh")
            continue
        split += 1
        placement = p.placements[names.index("tp")]
        if placement != Shard(dim):
            wrong.append(f"{name} is {placement}, expected Shard({dim})")
    return {"wrong": wrong, "split": split, "numel": sum(p.numel() for p in m.parameters()),
            "tp_local_numel": round(local)}


def describe_meshes(m):
    """The meshes the parameters live on: names and sizes."""
    from torch.distributed.tensor import DTensor
    seen = {}
    for p in m.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            key = tuple(mesh.mesh_dim_names or ())
            seen[",".join(key)] = list(mesh.mesh.shape)
    return seen


# ==================================================================================================
# The collectives lesson, train/collectives.py (TODOs 49-54; selfcheck/steps/collectives.py).
# Added for issue 20; nothing above depends on it. Its functions are called with inputs whose
# answers are known: the pure ones (the alpha-beta fit, DDP's predicted all-reduce time, the
# time read from a trace) as soon as the script is imported; the ring's parts on every rank
# right after the script's setup() has joined the process group, before the script's own code
# uses them. The reduce-scatter and the all-gather are tried with a correct send/receive step
# of the probe's own, so that each part is judged on its own; the whole ring_all_reduce then
# runs with the script's own parts. Results: record["lesson"]; every collective the script's
# ring functions call is in record["calls"] (the probe wraps them) with its function.

LESSON_FIT = dict(sizes=[2**k for k in range(10, 21)], world_size=4, latency=30e-6, busbw=6e9)
# measured times are noisy: the same times, each off by a few per cent (fixed, so every run of
# the check gives the same answer); least squares through all points is the answer to match
LESSON_NOISE = [1 + 0.08 * math.sin(2.7 * i + 1) for i in range(len(LESSON_FIT["sizes"]))]


def lesson_fit_times(noisy: bool = False) -> list[float]:
    f = LESSON_FIT
    factor = 2 * (f["world_size"] - 1) / f["world_size"]
    exact = [f["latency"] + s * factor / f["busbw"] for s in f["sizes"]]
    return [t * e for t, e in zip(exact, LESSON_NOISE, strict=True)] if noisy else exact


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope
LESSON_PREDICT = dict(layers=4, width=2048, world_size=4, latency=1e-3, busbw=2e9)
LESSON_RING_SHAPES = (((2,), "float32"), ((14,), "float32"), ((1001,), "float32"),
                      ((7, 33), "float64"))


def lesson_traces() -> dict:
    """Two profiler traces in the Chrome format torch.profiler writes, with what must be read
    from them: gloo on CPUs (3 steps, 21 ms of gloo:all_reduce: 7 ms per step) and NCCL on a
    GPU (2 steps, 2 ms of AllReduce kernels: 1 ms per step), each with the events that must not
    be counted (the CPU-side launches, other kernels, the GPU copies of the step ranges)."""
    def ev(name, cat, dur, ts=0):
        return {"ph": "X", "name": name, "cat": cat, "dur": dur, "ts": ts, "pid": 1, "tid": 1}
    cpu = [ev(f"ProfilerStep#{i}", "user_annotation", 200000) for i in (3, 4, 5)]
    cpu += [ev("gloo:all_reduce", "user_annotation", d) for d in (1000, 2000, 3000, 4000, 5000,
                                                                  6000)]
    cpu += [ev("c10d::allreduce_", "cpu_op", 100) for _ in range(6)]
    cpu += [ev("communication", "user_annotation", 900), ev("aten::mm", "cpu_op", 5000),
            ev("backward", "user_annotation", 90000)]
    gpu = [ev(f"ProfilerStep#{i}", cat, 50000) for i in (1, 2)
           for cat in ("user_annotation", "gpu_user_annotation")]
    gpu += [ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
               "kernel", d) for d in (500, 700, 800)]
    gpu += [ev("nccl:all_reduce", "user_annotation", 60) for _ in range(3)]
    gpu += [ev("nccl:all_reduce", "gpu_user_annotation", 650) for _ in range(3)]
    gpu += [ev("c10d::allreduce_", "cpu_op", 40) for _ in range(3)]
    gpu += [ev("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel",
               900), ev("ampere_sgemm_128x64_tn", "kernel", 3000),
            ev("cudaLaunchKernel", "cuda_runtime", 5)]
    # a real trace names its processes and threads in metadata events, with no "cat" or "dur"
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "thread 1"}}]
    return {"cpu": ({"traceEvents": meta + cpu, "displayTimeUnit": "ms"}, 7e-3),
            "gpu": ({"traceEvents": meta + gpu, "displayTimeUnit": "ms"}, 1e-3)}


def lesson_model(p: dict):
    """A stack of square linear layers on the meta device (shapes only): 3 DDP buckets."""
    import torch
    return torch.nn.Sequential(*(torch.nn.Linear(p["width"], p["width"], device="meta")
                                 for _ in range(p["layers"])))


def model_flops(model, flops_per_token) -> dict:
    """The parameters of a TransformerLM that MFU counts (its matmuls' weights, the output
    projection's too: the embedding tables are lookups), all its parameters, and the FLOPs per
    token of each count (TODO 42); and the output projection's own. The check's vocabulary is
    tiny: there the tables change the FLOPs by a few per cent only, so the check compares
    counts, not just printed MFUs."""
    cfg = model.cfg
    counts = {"matmuls": model.num_params(exclude_embeddings=True), "all": model.num_params()}
    output = getattr(model, "output", None)
    return {**counts, **{f"flops_{what}": flops_per_token(n, cfg.n_layers, cfg.d_model,
                                                          cfg.max_seq_len)
                         for what, n in counts.items()},
            "output": output.weight.numel() if output is not None else 0}


def lesson_call(fn, *args) -> dict:
    """{"value": what fn returned (numbers as floats)} or {"error": one line}."""
    try:
        value = fn(*args)
    except Exception as e:  # noqa: BLE001 - the participant's function: reported, not raised
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    if isinstance(value, (tuple, list)):
        value = [float(v) if isinstance(v, (int, float)) else repr(v)[:80] for v in value]
    elif isinstance(value, (int, float)):
        value = float(value)
    else:
        value = repr(value)[:80]
    return {"value": value}


class _StandInEvent:
    """One row of profiler.key_averages(), in microseconds, as torch reports it: where it ran
    (device_type) and whether it is a range (record_function, ProfilerStep) rather than an
    operator or a kernel (is_user_annotation)."""

    def __init__(self, key, count, cpu_total, self_cpu, self_device, device_total,
                 device_type=None, is_user_annotation=False):
        from torch.autograd import DeviceType
        self.key, self.count = key, count
        self.device_type = DeviceType.CPU if device_type is None else device_type
        self.is_user_annotation = is_user_annotation
        self.cpu_time_total, self.self_cpu_time_total = cpu_total, self_cpu
        self.self_device_time_total = self.self_cuda_time_total = self_device
        self.device_time_total = self.cuda_time_total = device_total


class _StandInProfiler:
    """A stopped profiler of 4 steps of 10 ms on the CPU each, with `kernel_ms` of kernels per
    step on a GPU (0: a CPU run): what gpu_busy (TODO 59) reads, without a GPU. The rows are
    Kineto's: the steps are one row, "ProfilerStep*", that counts them; a CPU operator's row
    holds the time of the kernels it launched (self_device_time_total), and each kernel has a
    row of its own on the GPU with the same time again; the ranges (ProfilerStep, "forward")
    have a row on the GPU too (is_user_annotation), as long as the GPU worked in them. A CPU
    run has no GPU rows. (Four steps, not the lesson's 3 active steps: a gpu_busy that divides
    by PROFILE_ACTIVE shows.)

    Per step on a GPU busy 6 ms, these sums give: the kernels' rows 6 (right); every row's
    self device time 25.5 (kernels twice, and the GPU's ranges 9 + 4.5); the GPU's rows with
    the ranges 19.5; the CPU operators and the kernels 12; device_time_total of every row
    42.3. Both ProfilerStep* rows counted: 8 steps, 5 ms each (selfcheck/steps/perf.py).
    tests/test_perf_lesson.py holds these rows against what torch's own key_averages() makes
    of such a profile's events."""

    def __init__(self, kernel_ms: float):
        from torch.autograd import DeviceType
        mm, add = 0.8 * kernel_ms * 4e3, 0.2 * kernel_ms * 4e3  # µs over the 4 steps
        kernels = mm + add
        # an operator's own (self) CPU time leaves out the operators inside it; the range
        # "forward" holds aten::linear (which runs aten::mm) and aten::add
        self.rows = [
            _StandInEvent("ProfilerStep*", 4, 40e3, 25e3, 0.0, kernels, is_user_annotation=True),
            _StandInEvent("forward", 4, 15e3, 1e3, 0.0, kernels, is_user_annotation=True),
            _StandInEvent("aten::linear", 40, 12e3, 4e3, 0.0, mm),  # mm runs inside
            _StandInEvent("aten::mm", 40, 8e3, 8e3, mm, mm),
            _StandInEvent("aten::add", 40, 2e3, 2e3, add, add)]
        if kernel_ms:
            gpu = DeviceType.CUDA
            self.rows += [
                _StandInEvent("ampere_sgemm_128x64_tn", 40, 0.0, 0.0, mm, mm, gpu),
                _StandInEvent("vectorized_elementwise_kernel", 40, 0.0, 0.0, add, add, gpu),
                # the ranges on the GPU: from their first kernel's start to their last's end
                _StandInEvent("ProfilerStep*", 4, 0.0, 0.0, 1.5 * kernels, 1.5 * kernels, gpu,
                              is_user_annotation=True),
                _StandInEvent("forward", 4, 0.0, 0.0, 0.75 * kernels, 0.75 * kernels, gpu,
                              is_user_annotation=True)]

    def key_averages(self, *a, **k):
        return self.rows


def performance_lesson(probe, module) -> None:
    """TODO 59's gpu_busy on stand-in profiles: a GPU busy 6 ms of each 10 ms step, a CPU run;
    the profiling window the script's constants describe (TODO 43); and, where the check asks
    (CHECK_EVAL_PAUSE seconds), each evaluation made that much longer and its start and end
    recorded: a tokens/s interval that counts an evaluation then stands out from the jitter
    of a loaded machine (TODO 42), where the tiny preset's own evaluation takes milliseconds;
    and, where the check asks (CHECK_PROFILER_WINDOWS), the window profiler_window gives runs of
    a few steps and long ones, at the script's first call of it (TODO 43): the check's runs take
    1 and 10 steps only."""
    pause = float(os.environ.get("CHECK_EVAL_PAUSE") or 0)
    if pause and callable(getattr(module, "evaluate", None)):
        windows = probe.record.setdefault("eval_windows", [])
        original = module.evaluate

        def evaluate(*a, **k):
            start = time.perf_counter()
            time.sleep(pause)
            try:
                return original(*a, **k)
            finally:
                windows.append([start, time.perf_counter()])
        module.evaluate = functools.wraps(original)(evaluate)
    window = [getattr(module, f"PROFILE_{n}", None) for n in ("WAIT", "WARMUP", "ACTIVE")]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in window):
        probe.record["profile_window"] = window
    window_of = getattr(module, "profiler_window", None)
    if callable(window_of) and os.environ.get("CHECK_PROFILER_WINDOWS"):
        # asked when the script first calls it, after setup: a window that says something on
        # rank 0 only may ask the process group for its rank
        def first_call(*a, **k):
            module.profiler_window = window_of
            probe.record["profiler_windows"] = profiler_windows(
                probe, getattr(window_of, "__wrapped__", window_of))  # (not as the script's call)
            return window_of(*a, **k)
        module.profiler_window = functools.wraps(window_of)(first_call)
    if callable(getattr(module, "gpu_busy", None)):
        probe.record["gpu_busy"] = {
            "gpu": lesson_call(module.gpu_busy, _StandInProfiler(6.0)),
            "cpu": lesson_call(module.gpu_busy, _StandInProfiler(0.0))}


# the runs profiler_window is asked about: every length up to 12 steps (--max-steps 3 is a
# usual first try), and two long runs (a window that grows with the run is not bounded)
WINDOW_STEPS = (*range(13), 1000, 100_000)


def profiler_windows(probe, window_of) -> dict:
    """{steps: lesson_call(profiler_window, steps)} for WINDOW_STEPS. What it prints is left
    out of the record and the output: the check reads the run's own lines."""
    record = probe.record
    prints, calls, on_print = len(record["prints"]), len(record["calls"]), probe.on_print
    probe.on_print = None  # (the stand-in GPU's timeline)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return {str(n): lesson_call(window_of, n) for n in WINDOW_STEPS}
    finally:
        del record["prints"][prints:], record["calls"][calls:]
        probe.on_print = on_print


def collectives_lesson(probe, module) -> None:
    if not callable(getattr(module, "ring_all_reduce", None)):
        return
    lesson = probe.record["lesson"] = {}
    f = LESSON_FIT
    if callable(getattr(module, "fit_alpha_beta", None)):
        lesson["fit"] = lesson_call(module.fit_alpha_beta, list(f["sizes"]), lesson_fit_times(),
                                    f["world_size"])
        lesson["fit_noisy"] = lesson_call(module.fit_alpha_beta, list(f["sizes"]),
                                          lesson_fit_times(noisy=True), f["world_size"])
    if callable(getattr(module, "predict_ddp_allreduce_s", None)):
        p = LESSON_PREDICT
        model = lesson_model(p)
        lesson["predict"] = lesson_call(module.predict_ddp_allreduce_s, model, p["world_size"],
                                        p["latency"], p["busbw"])
    if callable(getattr(module, "allreduce_seconds_per_step", None)):
        lesson["trace"] = {kind: lesson_call(module.allreduce_seconds_per_step, trace)
                           for kind, (trace, _) in lesson_traces().items()}

    # the other collectives, so that a "ring" made of them shows (all_reduce and broadcast
    # are recorded by install())
    import torch.distributed as dist
    for name in ("all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all",
                 "all_to_all_single", "reduce"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*a, _name=name, _original=original, **k):
            probe.note_call(f"dist.{_name}")
            return _original(*a, **k)
        setattr(dist, name, functools.wraps(original)(wrapper))

    # point-to-point requests: which of the script's isend/irecv requests were waited for
    # (one never waited for can be cancelled when it is dropped: its receiver waits forever)
    import torch.distributed.distributed_c10d as c10d
    requests = probe.record.setdefault("requests", [])
    failed = []

    class Request:
        """isend's or irecv's request, with a note of whether wait() was called on it."""

        def __init__(self, work, entry):
            self._work, self._entry = work, entry

        def wait(self, *a, **k):
            self._entry["waited"] = True
            try:
                return self._work.wait(*a, **k)
            except BaseException:
                failed.append(True)  # the requests an error leaves behind are not "dropped"
                raise

        def __getattr__(self, name):
            return getattr(self._work, name)

        def __del__(self):  # dropped without wait() (not: left behind by an error)
            if not self._entry["waited"] and not failed and not probe.record.get("error"):
                self._entry["dropped"] = True

    def note_peer_outside(name, a, k):
        """A send to (or a receive from) a rank that does not exist, rank + 1 on the last rank:
        noted before the call, which then waits until the store times out (or gloo ends the
        process: the note is written to a file of its own at once)."""
        peer = a[1] if len(a) > 1 else next((k[key] for key in ("dst", "src", "group_dst",
                                                                  "group_src")
                                              if k.get(key) is not None), None)
        group = k.get("group") or (a[2] if len(a) > 2 else None)
        if not isinstance(peer, int) or not dist.is_initialized():
            return
        size = dist.get_world_size(group)
        where = probe.script_line(3)
        if not 0 <= peer < size and where is not None:
            outside = probe.record.setdefault("peers_outside", [])
            outside.append({"name": name, "peer": peer, "rank": dist.get_rank(),
                            "world_size": size, "func": where[0], "line": where[1]})
            (probe.dump_dir / f"peers{probe.rank}.json").write_text(json.dumps(outside))

    for name in ("isend", "irecv"):
        original = getattr(c10d, name)

        def p2p(*a, _name=name, _original=original, **k):
            note_peer_outside(_name, a, k)
            work = _original(*a, **k)
            where = probe.script_line(2)
            if work is None or where is None or len(requests) >= 200:
                return work
            entry = {"name": _name, "func": where[0], "line": where[1], "waited": False,
                     "dropped": False}
            requests.append(entry)
            return Request(work, entry)
        wrapped = functools.wraps(original)(p2p)
        # the same object under both names: P2POp and batch_isend_irecv compare `op is isend`
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)

    setup = getattr(module, "setup", None)
    if callable(setup):
        @functools.wraps(setup)
        def setup_then_ring(*a, **k):
            result = setup(*a, **k)
            if dist.is_initialized() and dist.get_world_size() > 1:
                lesson["ring"] = {}  # filled part by part: a crash keeps what came before
                # and written part by part too: gloo's abort of a rank loses its record
                progress = probe.dump_dir / f"ring{probe.rank}.json"
                lesson_ring(module, lesson["ring"],
                            lambda: progress.write_text(json.dumps(lesson["ring"])))
            return result
        module.setup = setup_then_ring


def lesson_value(rank, i):
    """What rank `rank` contributes at position i: small integers, so every sum is exact."""
    return (rank + 1) * 10 + i % 7


def lesson_ring(module, out: dict, save=lambda: None) -> None:
    import torch
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    out.update(rank=rank, world_size=n)

    # the steps each part makes: a rank that makes fewer than the others goes on while they
    # still wait for its message, and the error surfaces in a later part
    steps = out["steps"] = {}

    def correct_exchange(send, recv):
        part = out.get("running", "other")
        steps[part] = steps.get(part, 0) + 1
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),
                                               dist.P2POp(dist.irecv, recv, left)]):
            request.wait()

    # 1. one step of the ring, the script's own
    if callable(getattr(module, "send_right_receive_left", None)):
        send, recv = torch.full((5,), 100.0 + rank), torch.full((5,), -1.0)
        module.send_right_receive_left(send, recv)
        out["exchange"] = {"received": sorted(set(recv.tolist())), "left": 100.0 + left,
                           "right": 100.0 + right,
                           "sent_intact": bool((send == 100.0 + rank).all())}
    length = 4 * n + 2  # chunks of unequal sizes
    i = torch.arange(length)
    total = sum(lesson_value(q, i) for q in range(n)).float()
    own = module.send_right_receive_left if hasattr(module, "send_right_receive_left") else None

    def complete(views) -> list[int]:
        return [c for c, v in enumerate(views)
                if torch.equal(v, total.tensor_split(n)[c])]

    try:
        if own is not None:
            module.send_right_receive_left = correct_exchange
        # 2. the reduce-scatter
        if callable(getattr(module, "ring_reduce_scatter", None)):
            x = lesson_value(rank, i).float()
            chunks = list(x.tensor_split(n))
            out["running"] = "reduce_scatter"
            module.ring_reduce_scatter(chunks)
            del out["running"]
            save()
            out["reduce_scatter"] = {
                "complete": complete(x.tensor_split(n)),
                "complete_in_list": complete(chunks) if len(chunks) == n else [],
                "expected": (rank + 1) % n,
                "changed": not torch.equal(x, lesson_value(rank, i).float()),
                # the chunk this rank should complete, and its sum (a mean shows as sum / n)
                "held": x.tensor_split(n)[(rank + 1) % n].tolist(),
                "sum": total.tensor_split(n)[(rank + 1) % n].tolist()}
        # 3. the all-gather, from the state a right reduce-scatter leaves
        if callable(getattr(module, "ring_all_gather", None)):
            x = torch.full((length,), -1.0)
            mine = (rank + 1) % n
            x.tensor_split(n)[mine].copy_(total.tensor_split(n)[mine])
            out["running"] = "all_gather"
            chunks = list(x.tensor_split(n))
            module.ring_all_gather(chunks)
            del out["running"]
            save()
            out["all_gather"] = {"complete": complete(x.tensor_split(n)),
                                 "complete_in_list": complete(chunks) if len(chunks) == n else [],
                                 "wrong": int((x != total).sum())}
    finally:
        if own is not None:
            module.send_right_receive_left = own
    # 4. the whole ring, with the script's own parts
    wrong, elements, failed = 0, 0, []
    for shape, dtype in LESSON_RING_SHAPES:
        x = lesson_value(rank, torch.arange(math.prod(shape))).to(getattr(torch, dtype))
        x = x.reshape(shape)
        expected = sum(lesson_value(q, torch.arange(x.numel())) for q in range(n)).reshape(shape)
        result = module.ring_all_reduce(x)
        if not isinstance(result, torch.Tensor) or result.shape != x.shape:
            result = x
        bad = int((result.double() != expected.double()).sum())
        wrong, elements = wrong + bad, elements + x.numel()
        if bad:
            failed.append(f"{list(shape)} {dtype}")
    out["all_reduce"] = {"wrong": wrong, "elements": elements, "failed": failed}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    Probe(argv[0], argv[1:]).run()


if __name__ == "__main__":
    main()
