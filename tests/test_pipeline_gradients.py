"""Every pipeline schedule computes the gradients of one process: after a step, every parameter's
gradient on the rank that holds it equals the single-process gradient of the same batch's mean
loss, with more microbatches than stages. (Pipelines that sum the microbatch losses where they
should average them, or scale gradients differently with and without PP, train with the wrong
learning rate and still lower their loss: only a comparison of the gradients finds them.)

The ranks build their stages with the lesson's and the capstone's own functions
(split_pipeline_stage, build_schedule, split_rank_stages, apply_tp, apply_fsdp) and run two
steps, with an SGD update in between, so that nothing a schedule keeps from one step leaks into
the next.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import load_script
from distributed import run_distributed
from model import TransformerLM, get_config

LR, STEPS = 0.5, 2
VOCAB, SEQ = 64, 16


def make_model(n_layers: int) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ, n_layers=n_layers,
                                    dropout=0.0))


def batches(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),
             torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)) for _ in range(STEPS)]


def single_process_gradients(n_layers: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The reference: each step's gradients of the whole batch's mean loss, then SGD."""
    model, out = make_model(n_layers), []
    for x, y in batches(batch_size):
        model.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_steps(model, schedule, has_first, has_last, batch_size, dp_rank=0, dp=1, context=None):
    """STEPS pipeline steps on this rank's share of every batch: its gradients, by name."""
    import contextlib
    out = []
    for x, y in batches(batch_size):
        share = batch_size // dp
        x, y = x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share]
        model.zero_grad()
        with context() if context else contextlib.nullcontext():
            schedule.step(*((x,) if has_first else ()), target=y if has_last else None,
                          losses=[])
        out.append({n: full(p.grad).clone() for n, p in model.named_parameters()
                    if p.grad is not None})  # (a parameter without one is reported missing)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return out


def _lesson(rank, world_size, schedule_name, microbatches, batch_size):
    """solutions/train/pp_training.py's stage and schedule, one stage per rank."""
    from torch.distributed.pipelining import PipelineStage
    pp = load_script("solutions/train/pp_training.py")
    model = pp.split_pipeline_stage(make_model(world_size), rank, world_size)
    stage = PipelineStage(model, rank, world_size, torch.device("cpu"))
    schedule = pp.build_schedule(schedule_name, stage, microbatches, pp.lm_loss)
    return train_steps(model, schedule, stage.is_first, stage.is_last, batch_size)


def _capstone(rank, world_size, schedule_name, microbatches, batch_size, pp, dp, tp,
              stages_per_rank):
    """solutions/train/nd_training.py's stages: TP, then FSDP, several stages per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    nd = load_script("solutions/train/nd_training.py")
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    model, _, stages = nd.build_pipeline(make_model(pp * stages_per_rank), mesh,
                                         torch.device("cpu"), schedule_name, stages_per_rank)
    schedule = nd.build_schedule(schedule_name, stages, microbatches, nd.lm_loss)
    return train_steps(model, schedule, stages[0].is_first, stages[-1].is_last, batch_size,
                       mesh["dp"].get_local_rank(), dp, context=loss_parallel)


def _worker(rank, world_size, cases):
    results = {}
    for name, (kind, args) in cases.items():
        results[name] = (_lesson if kind == "lesson" else _capstone)(rank, world_size, *args)
    return results


# name: (script, (schedule, microbatches, batch size[, pp, dp, tp, stages per rank]))
TWO_RANKS = {
    "gpipe": ("lesson", ("gpipe", 4, 8)),
    "1f1b": ("lesson", ("1f1b", 4, 8)),
    "zero-bubble": ("lesson", ("zero-bubble", 4, 8)),
    "interleaved-1f1b, 2 stages per rank": ("capstone", ("interleaved-1f1b", 8, 16, 2, 1, 1, 2)),
    "zero-bubble, 2 stages per rank": ("capstone", ("zero-bubble", 8, 16, 2, 1, 1, 2)),
}
FOUR_RANKS = {
    "1f1b, pp 2 x dp 2": ("capstone", ("1f1b", 4, 16, 2, 2, 1, 1)),
    "zero-bubble, pp 2 x dp 2": ("capstone", ("zero-bubble", 4, 16, 2, 2, 1, 1)),
    "interleaved-1f1b, pp 2 x tp 2": ("capstone", ("interleaved-1f1b", 4, 8, 2, 1, 2, 2)),
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_worker, 2, TWO_RANKS, timeout=600)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_worker, 4, FOUR_RANKS, timeout=600)


def check(results, case, n_layers, batch_size):
    reference = single_process_gradients(n_layers, batch_size)
    for step, want in enumerate(reference):
        got = {}
        for rank in results:
            got.update(rank[case][step])
        assert set(got) == set(want), f"step {step}: gradients of {sorted(set(want) - set(got))} missing"
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, s=step, n=name: f"{case}, step {s}, {n}: {m}")


@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_every_schedule_computes_the_single_process_gradients(case, two_ranks):
    kind, args = TWO_RANKS[case]
    n_layers = 2 if kind == "lesson" else args[3] * args[6]
    check(two_ranks, case, n_layers, args[2])


@pytest.mark.parametrize("case", list(FOUR_RANKS))
def test_with_data_or_tensor_parallelism_too(case, four_ranks):
    _, args = FOUR_RANKS[case]
    check(four_ranks, case, args[3] * args[6], args[2])
