"""setup_env.sh on a cluster's GPU node and login node, with stand-ins for nvidia-smi, sbatch,
the environment's python and pip (CI runs the real script on a CPU machine, where its CUDA
branch never runs).

The stand-in python answers setup_env's few questions about torch from a state file that the
stand-in pip writes: PyPI's build is for CUDA 13.0, an index URL ending in cu126 gives a build
for CUDA 12.6, and only a build for at most the driver's CUDA version can use the GPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, script_env

FAKE_PYTHON = r"""#!/bin/bash
state=$(dirname "$0")/../state
if [ "$1" = -m ] && [ "$2" = pip ]; then
    echo "${*:3}" >> "$state/pip.log"
    [[ "$*" == *"-r requirements.txt"* ]] && touch "$state/numpy"
    [[ "$*" == *"uninstall -y -q torch"* ]] && rm "$state/torch"
    if [[ "$*" == *"install torch=="* ]]; then  # the torch line, not requirements.txt's
        build=cu130; [[ "$*" == *whl/cu126* ]] && build=cu126
        cuda=$([ $build = cu126 ] && echo 12.6 || echo 13.0)
        usable=$(awk -v t="$cuda" -v d="$(cat "$state/driver")" 'BEGIN {print (t <= d) ? "True" : "False"}')
        echo "2.13.0+$build $cuda $usable" > "$state/torch"
    fi
    exit 0
fi
[ -f "$state/torch" ] || exit 1  # no torch installed: the import fails
read -r version cuda usable < "$state/torch"
if [[ "${*: -1}" == *"import torch"* ]] && [ ! -f "$state/numpy" ]; then
    echo "UserWarning: Failed to initialize NumPy: No module named 'numpy'" >&2  # as torch does
fi
case "${*: -1}" in
    *split*) echo "${version%%+*}" ;;
    *importlib.metadata*) echo "$version" ;;
    *"is_available(), torch.version.cuda"*) echo "$usable $cuda" ;;
    *"model, utils"*) echo "setup_env: torch $version, CUDA available: $usable" ;;
    *) echo "$version" ;;
esac
"""

FAKE_NVIDIA_SMI = r"""#!/bin/bash
if [ "${1:-}" = -L ]; then echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0)"; exit 0; fi
echo "| NVIDIA-SMI 560.35.03   Driver Version: 560.35.03   CUDA Version: $(cat "$DRIVER_FILE") |"
"""


def setup_on_a_gpu_node(tmp_path: Path, driver_cuda: str, tool="nvidia-smi",
                        **env) -> subprocess.CompletedProcess:
    """setup_env.sh on a node where `tool` (nvidia-smi, or sbatch on a login node) exists."""
    venv, tools = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    (venv / "state").mkdir(exist_ok=True)
    (venv / "state" / "driver").write_text(driver_cuda)
    tools.mkdir()
    for path, text in ((venv / "bin" / "python", FAKE_PYTHON),
                       (tools / tool, FAKE_NVIDIA_SMI)):
        path.write_text(text)
        path.chmod(0o755)
    run_env = script_env()
    for knob in ("TORCH_VARIANT", "TORCH_INDEX_URL", "PYTHON"):
        run_env.pop(knob, None)
    run_env.update(VENV=str(venv), SKIP_DATA="1", DRIVER_FILE=str(venv / "state" / "driver"),
                   PATH=f"{tools}:{run_env['PATH']}", **env)
    return subprocess.run(["bash", str(ROOT / "setup_env.sh")], env=run_env, capture_output=True,
                          text=True, timeout=60)


def pip_calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "venv" / "state" / "pip.log").read_text().splitlines()


def test_on_a_gpu_node_it_installs_the_cuda_build_from_pypi_and_checks_torch_can_use_the_gpu(
        tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="13.0")
    assert done.returncode == 0, done.stderr
    assert "torch variant 'cuda'" in done.stdout
    assert "setup_env: torch 2.13.0+cu130, CUDA available: True" in done.stdout
    assert pip_calls(tmp_path)[0] == "--disable-pip-version-check install torch==2.13.0"


def test_a_driver_older_than_torch_s_cuda_stops_with_one_line_naming_both_and_the_fix(tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="12.6")
    assert done.returncode == 1
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith("setup_env: error: torch 2.13.0+cu130 is built for CUDA 13.0 but "
                           "cannot use the GPU that nvidia-smi sees (its driver: CUDA Version: "
                           "12.6): install a build for that CUDA version, e.g. rm -rf ")
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash setup_env.sh" in line


def test_torch_index_url_picks_the_cuda_build_that_the_driver_supports(tmp_path):
    url = "https://download.pytorch.org/whl/cu126"
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="12.6", TORCH_INDEX_URL=url)
    assert done.returncode == 0, done.stderr
    assert pip_calls(tmp_path)[0] == f"--disable-pip-version-check install torch==2.13.0 --index-url {url}"
    assert "setup_env: torch 2.13.0+cu126, CUDA available: True" in done.stdout


@pytest.mark.parametrize("variant", ["cpu", "module"])
def test_the_gpu_check_is_only_for_the_cuda_build(tmp_path, variant):
    # With the CPU wheel (or a centre's module) on a GPU node, the user chose it: no error.
    (tmp_path / "venv" / "state").mkdir(parents=True)
    (tmp_path / "venv" / "state" / "torch").write_text("2.13.0+cpu None False\n")
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="12.6", TORCH_VARIANT=variant)
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr


def test_on_a_login_node_without_gpus_it_says_how_to_get_the_cuda_build_for_the_gpu_nodes(
        tmp_path):
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi: setup_env.sh would pick the CUDA build")
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="13.0", tool="sbatch")
    assert done.returncode == 0, done.stderr
    assert "torch variant 'cpu'" in done.stdout
    assert ("setup_env: note: no GPU here, so the CPU build of torch; for this cluster's GPU "
            "nodes use TORCH_VARIANT=cuda bash setup_env.sh") in done.stdout


def test_the_cuda_build_replaces_the_cpu_build_of_an_earlier_run_on_the_login_node(tmp_path):
    # What the login-node note and the scripts' warning tell users to run next.
    (tmp_path / "venv" / "state").mkdir(parents=True)
    (tmp_path / "venv" / "state" / "torch").write_text("2.13.0+cpu None False\n")
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="13.0", TORCH_VARIANT="cuda")
    assert done.returncode == 0, done.stderr
    assert pip_calls(tmp_path)[:2] == ["--disable-pip-version-check uninstall -y -q torch",
                                       "--disable-pip-version-check install torch==2.13.0"]
    assert "setup_env: torch 2.13.0+cu130, CUDA available: True" in done.stdout


def test_a_fresh_setup_never_imports_torch_before_numpy_is_there(tmp_path):
    """torch imported before requirements.txt (which brings NumPy) prints "Failed to
    initialize NumPy" into the first thing a participant sees."""
    proc = setup_on_a_gpu_node(tmp_path, "13.0", TORCH_VARIANT="cuda")
    assert proc.returncode == 0, proc.stderr
    assert "Failed to initialize NumPy" not in proc.stdout + proc.stderr
