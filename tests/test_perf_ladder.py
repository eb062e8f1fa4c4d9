"""benchmarks/bench_perf_ladder.py, the performance step's ladder: its rows are the lesson's
fixes, extra rows change the last one, it sorts a GPU profile's kernels by what they do, and it
runs on a CPU. (Its figures come from a GPU: docs/performance.md.)"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_perf_ladder.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_perf_ladder", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_each_row_of_the_ladder_adds_one_fix_and_the_last_is_the_steps_last_setting(bench):
    rows = bench.ladder(32, 128)
    assert len(rows) == 11
    assert (rows[0].precision, rows[0].compile, rows[0].ddp) == ("fp32", "none", True)
    last = rows[-1]
    assert (last.precision, last.fused, last.compile, last.mode, last.batch, last.pad_vocab,
            last.ddp) == ("bf16", True, "blocks+loss", None, 128, 64, False)


def test_extra_rows_change_the_last_setting_and_names_joined_by_plus_combine(bench):
    full = bench.ladder(32, 128)
    eleven, both = bench.chosen_rows(full, "11,model+nodrop")
    assert eleven == full[-1]
    assert (both.compile, both.dropout, both.batch, both.label) == ("model+loss", 0.0, 128,
                                                                     "model+nodrop")


@pytest.mark.parametrize("spec", ["12", "0", "model+nodorp", "fast"])
def test_a_row_that_does_not_exist_is_named_with_the_rows_there_are(bench, spec):
    with pytest.raises(SystemExit, match=r"no row .*row numbers 1-11 or names of nodrop"):
        bench.chosen_rows(bench.ladder(32, 128), spec)


@pytest.mark.parametrize("name, kind", [  # kernel names from the H200 run of 2026-11-27
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64", "attention"),
    ("triton_poi_fused_gelu_gelu_backward_view_4", "fused by compile (Triton)"),
    ("triton_red_fused__log_softmax_prepare_softmax_online_view_0", "fused by compile (Triton)"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "optimizer"),
    ("void at::native::elementwise_kernel<128, 4>", "other")])
def test_a_kernel_is_sorted_by_what_its_name_says_it_does(bench, name, kind):
    assert bench.kernel_kind(name) == kind


def test_the_ladder_runs_on_a_cpu_and_prints_its_table(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--vocab", "500",
                          "--rows", "1,3", "--warmup", "1", "--steps", "1",
                          "--json", str(tmp_path / "rows.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| fp32 (as shipped) |" in out.stdout and "| bf16 autocast |" in out.stdout
    assert (tmp_path / "rows.json").read_text().count('"tokens_per_s"') == 2
