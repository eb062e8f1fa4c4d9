"""tools/plan_run.py: the capstone's layout built on a fake process group of the full size, in
this process. Bad layouts get one line per problem and exit 1; good ones get memory and
collectives per rank. (tests/test_nd_training.py holds a plan to a real 8-process run.)"""

from __future__ import annotations

import json
import math

import pytest

from conftest import load_script

WORKSHOP_2x4 = ["--preset", "workshop", "--nodes", "2", "--gpus-per-node", "4", "--site", "jsc"]


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/plan_run.py")


def plan(tool, capsys, *argv):
    """(exit status, stdout, stderr lines) of the tool's main with these arguments."""
    status = tool.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("argv, expected", [
    # 12 heads do not split over 8; 8 GPUs of TP on nodes of 4; 4 microbatches of 6 sequences
    (["--tp", "8", "--pp", "1", "--global-batch", "6"],
     ["n_heads 12 and d_ff 3072 must be divisible by --tp 8",
      "--microbatches 4 must be at least --pp 1 and divide --batch-size 6",
      "the TP group of ranks 0-7 spans nodes 0-1"]),
    # 8 ranks cannot hold 3 stages
    (["--tp", "1", "--pp", "3", "--global-batch", "8"],
     ["the 8 ranks (2 nodes x 4 GPUs) do not split into --tp 1 x --pp 3"]),
    # dp 2: 5 sequences do not split; 8 layers do not split into 4 stages of a 12-rank job
    (["--nodes", "3", "--tp", "2", "--pp", "3", "--global-batch", "5", "--microbatches", "2"],
     ["--global-batch 5 does not split over the 2 data-parallel replicas: give a multiple of 2",
      "the 8 layers do not split evenly into --pp 3 stages: give --n-layers 6 or --layers-per-stage",
      "--microbatches 2 must be at least --pp 3"]),
])
def test_a_layout_that_cannot_work_gets_one_line_per_problem_saying_what_to_change(
        tool, capsys, argv, expected):
    status, out, errors = plan(tool, capsys, *WORKSHOP_2x4, *argv)
    assert status == 1
    assert len(errors) == len(expected)
    for line, fragment in zip(errors, expected, strict=True):
        assert line.startswith("error: ") and fragment in line
    assert "layout:" in out and "the capstone's flags:" in out
    assert "built ranks" not in out  # nothing is built for a split that cannot work


def test_a_rank_that_does_not_fit_names_itself_its_bytes_and_what_to_change(tool, capsys):
    status, out, errors = plan(tool, capsys, "--params", "7e9", "--d-model", "4096", "--layers", 32,
                               "--seq-len", 4096, "--nodes", 1, "--gpus-per-node", 4, "--tp", 4,
                               "--pp", 1, "--global-batch", 1, "--microbatches", 1,
                               "--gpu-memory", 24)
    assert status == 1
    assert len(errors) == 2  # rank 0 and rank 3, the two ranks built
    assert errors[0].startswith("error: rank 0 (stage 0) needs ")
    assert "more than 90% of --gpu-memory 24 GiB" in errors[0]
    assert "a larger --tp or --pp, or more nodes" in errors[0]  # the weights dominate
    assert "NO" in out  # the table shows which rank


def test_a_good_layout_gets_memory_and_collectives_per_rank_and_its_json(tool, capsys,
                                                                          tmp_path):
    path = tmp_path / "plan.json"
    status, out, errors = plan(tool, capsys, *WORKSHOP_2x4, "--tp", 2, "--pp", 2,
                               "--global-batch", 64, "--json", path)
    assert (status, errors) == (0, [])
    assert "built ranks 0, 4, 7" in out
    result = json.loads(path.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 4, 7]
    first, last = result["ranks"][0], result["ranks"][-1]
    for row in result["ranks"]:  # the mesh the capstone built is the one the search assumes
        assert row["groups"] == tool.mesh_groups(row["rank"], 2, 2, 2)
    assert first["first"] and not first["last"] and last["last"] and not last["first"]
    assert first["where"] == {"pp": "across nodes", "dp": "inside a node", "tp": "inside a node"}
    # each rank holds about an eighth of the model, the first stage the embedding's share
    assert 0.1 < first["params"] / result["params"] < 0.2
    assert first["memory"]["total"] == pytest.approx(
        sum(first["memory"][k] for k in ("parameters", "gradients", "optimizer", "activations",
                                         "gathered")))
    ops = {(c["dim"], c["op"]) for c in first["collectives"]}
    assert {("tp", "all_reduce"), ("dp", "all_gather"), ("dp", "reduce_scatter"),
            ("pp", "send"), ("pp", "recv")} <= ops
    assert ("tp", "all_reduce") in {(c["dim"], c["op"]) for c in last["collectives"]
                                    if c["what"].startswith("loss_parallel")}
    # 1F1B, 4 microbatches: every block's weights are gathered once per forward that finds
    # them sharded and once more for the backward passes: 5 times for each of 4 blocks
    blocks = [c for c in first["collectives"] if c["what"].startswith("the blocks'")]
    assert {c["op"]: c["calls"] for c in blocks} == {"all_gather": 4 * 5, "reduce_scatter": 4}
    assert all(c["seconds"] > 0 for c in first["collectives"])


def test_the_search_builds_the_layout_with_the_shortest_step_that_fits(tool, capsys, tmp_path):
    path = tmp_path / "search.json"
    status, out, errors = plan(tool, capsys, *WORKSHOP_2x4, "--global-batch", 64,
                               "--microbatches", 2, "--json", path)
    assert (status, errors) == (0, [])
    found = json.loads(path.read_text())
    fitting = [c for c in found["candidates"] if c["fits"]]
    best = min(fitting, key=lambda c: c["estimate"]["step_s"])
    assert (found["plan"]["tp"], found["plan"]["pp"]) == (best["tp"], best["pp"])
    assert f"best: tp {best['tp']} x pp {best['pp']}" in out
    # TP stays inside a node; the layouts that cannot run say why
    assert {c["tp"] for c in found["candidates"]} <= {1, 2, 4}
    assert found["skipped"] and all(s["problems"] for s in found["skipped"])


def test_the_formulas_that_rank_the_search_are_what_the_built_layout_holds(tool, capsys,
                                                                           tmp_path):
    """The search ranks layouts from the model's shape without building them: the same units,
    modules and memory as the built capstone (FSDP pads its shards: within 1 %)."""
    path = tmp_path / "plan.json"
    plan(tool, capsys, *WORKSHOP_2x4, "--tp", 2, "--pp", 2, "--global-batch", 64, "--json", path)
    result = json.loads(path.read_text())
    args = tool.parse_args([*WORKSHOP_2x4, "--tp", "2", "--pp", "2", "--global-batch", "64"])[1]
    cfg = tool.model_config(args)
    for row in result["ranks"]:
        built = row["parts"]
        formula = tool.formula_parts(cfg, 2, len(row["layers"]), row["first"], row["last"])
        assert sorted((d, tool.generic(m), k, n) for d, m, k, n in built["tp"]) == \
            sorted((d, m, k, n) for d, m, k, n in formula["tp"])
        assert [u["reshard_after_forward"] for u in built["fsdp"]] == \
            [u["reshard_after_forward"] for u in formula["fsdp"]]
        for b, f in zip(built["fsdp"], formula["fsdp"], strict=True):
            assert b["bytes"] == pytest.approx(f["bytes"], rel=0.01)
    screened = tool.screen(cfg, args, 8, 4, 2, 2, tool.network_model(args, tool.read_site("jsc")))
    heaviest = max(r["memory"]["total"] for r in result["ranks"])
    assert screened["gib_per_rank"] * tool.GiB == pytest.approx(heaviest, rel=0.01)


def test_collective_times_follow_the_alpha_beta_fit_of_a_measured_benchmark(tool, capsys,
                                                                            tmp_path):
    latency, busbw, n = 25e-6, 40e9, 8  # an all-reduce on 8 ranks across nodes
    factor = 2 * (n - 1) / n
    records = [{"collective": "all_reduce", "bytes": s,
                "time_us": (latency + s * factor / busbw) * 1e6} for s in (2**20, 2**24, 2**28)]
    bench = tmp_path / "two_nodes.json"
    bench.write_text(json.dumps({"meta": {"world_size": n}, "records": records}))
    path = tmp_path / "plan.json"
    status, out, errors = plan(tool, capsys, *WORKSHOP_2x4, "--tp", 2, "--pp", 2,
                               "--global-batch", 64, "--bench-inter", bench, "--json", path)
    assert status == 0
    result = json.loads(path.read_text())
    link = result["network"]["across nodes"]
    assert link["latency_s"] == pytest.approx(latency)
    assert link["busbw_Bps"] == pytest.approx(busbw)
    # the pipeline's groups span the nodes: each send costs latency + bytes / bus bandwidth
    send = next(c for c in result["ranks"][0]["collectives"] if c["op"] == "send")
    assert send["where"] == "across nodes"
    assert send["seconds"] == pytest.approx(send["calls"] * (latency + send["bytes"] / busbw))
    assert math.isclose(result["network"]["inside a node"]["busbw_Bps"], 200e9)  # sites/jsc.env

    bench.write_text("not json")
    with pytest.raises(SystemExit, match=r"--bench-inter .*: not a JSON file of benchmarks/"):
        tool.main([*WORKSHOP_2x4, "--tp", "2", "--pp", "2", "--global-batch", "64",
                   "--bench-inter", str(bench)])
    with pytest.raises(SystemExit, match=r"--site nowhere: no sites/nowhere.env: one of "):
        tool.main([*WORKSHOP_2x4[:-1], "nowhere", "--global-batch", "64"])


@pytest.mark.slow
def test_a_7b_like_model_on_1024_fake_ranks_is_built_one_rank_per_stage(tool, capsys):
    status, out, errors = plan(tool, capsys, "--params", "7e9", "--d-model", 4096, "--layers", 32,
                               "--seq-len", 4096, "--nodes", 256, "--gpus-per-node", 4,
                               "--tp", 4, "--pp", 4, "--global-batch", 512, "--microbatches", 8)
    assert (status, errors) == (0, [])
    assert "1024 ranks = pp 4 x dp 64 x tp 4" in out
    assert "built ranks 0, 256, 512, 768, 1023" in out
