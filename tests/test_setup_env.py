"""setup_env.sh on a cluster's GPU node and login node, with stand-ins for nvidia-smi, rocm-smi,
uname, sbatch, the environment's python and pip (CI runs the real script on an x86 CPU machine,
where its CUDA and ROCm branches never run).

The stand-in python answers setup_env's few questions about torch from a state file that the
stand-in pip writes: PyPI's build is for CUDA 13.0 (on x86_64 and aarch64 alike), an index URL
ending in cu126 gives a build for CUDA 12.6, one ending in rocmX.Y a ROCm X.Y build, one ending in
cpu a CPU-only build; only a build for at most the node's CUDA (ROCm) version can use its GPU.
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
        build=cu130 cuda=13.0 hip=None needs=13.0
        case "$*" in
            *whl/cu126*) build=cu126 cuda=12.6 needs=12.6 ;;
            *whl/rocm*) hip=$(echo "$*" | grep -o 'whl/rocm[0-9.]*' | sed 's|whl/rocm||')
                        build=rocm$hip cuda=None needs=$hip ;;
            *whl/cpu*) build=cpu cuda=None needs=999 ;;
        esac
        usable=$(awk -v t="$needs" -v d="$(cat "$state/driver")" 'BEGIN {print (t <= d) ? "True" : "False"}')
        echo "2.13.0+$build $cuda $usable $hip" > "$state/torch"
    fi
    exit 0
fi
[ -f "$state/torch" ] || exit 1  # no torch installed: the import fails
read -r version cuda usable hip < "$state/torch"
if [[ "${*: -1}" == *"import torch"* ]] && [ ! -f "$state/numpy" ]; then
    echo "UserWarning: Failed to initialize NumPy: No module named 'numpy'" >&2  # as torch does
fi
case "${*: -1}" in
    *split*) echo "${version%%+*}" ;;
    *importlib.metadata*) echo "$version" ;;
    *"is_available(), torch.version.cuda, torch.version.hip"*) echo "$usable $cuda ${hip:-None}" ;;
    *"model, utils"*) echo "setup_env: torch $version, CUDA available: $usable" ;;
    *) echo "$version" ;;
esac
"""

FAKE_NVIDIA_SMI = r"""#!/bin/bash
if [ "${1:-}" = -L ]; then echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0)"; exit 0; fi
echo "| NVIDIA-SMI 560.35.03   Driver Version: 560.35.03   CUDA Version: $(cat "$DRIVER_FILE") |"
"""

# rocm-smi on a LUMI-G node: 8 GCDs, each a GPU[i] of its own
FAKE_ROCM_SMI = r"""#!/bin/bash
case "${1:-}" in
    --showproductname) for i in 0 1 2 3 4 5 6 7; do
                           printf 'GPU[%s]		: Card Series: 		AMD INSTINCT MI250X
' $i; done ;;
    --showdriverversion) printf 'Driver version: %s
' "$(cat "$DRIVER_FILE")" ;;
esac
"""

# uname -m as on the node: x86_64, or aarch64 on a Grace Hopper node
FAKE_UNAME = r"""#!/bin/bash
if [ "${1:-}" = -m ]; then echo "$FAKE_ARCH"; else /bin/uname "$@"; fi
"""


def setup_on_a_gpu_node(tmp_path: Path, driver_cuda: str, tool="nvidia-smi", arch="x86_64",
                        **env) -> subprocess.CompletedProcess:
    """setup_env.sh on a node where `tool` (nvidia-smi, rocm-smi, or sbatch on a login node)
    exists, whose driver supports CUDA (ROCm) `driver_cuda` and whose CPU is `arch`."""
    venv, tools = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    (venv / "state").mkdir(exist_ok=True)
    (venv / "state" / "driver").write_text(driver_cuda)
    tools.mkdir()
    for path, text in ((venv / "bin" / "python", FAKE_PYTHON),
                       (tools / tool, FAKE_ROCM_SMI if tool == "rocm-smi" else FAKE_NVIDIA_SMI),
                       (tools / "uname", FAKE_UNAME)):
        path.write_text(text)
        path.chmod(0o755)
    run_env = script_env()
    for knob in ("TORCH_VARIANT", "TORCH_INDEX_URL", "PYTHON"):
        run_env.pop(knob, None)
    run_env.update(VENV=str(venv), SKIP_DATA="1", DRIVER_FILE=str(venv / "state" / "driver"),
                   PATH=f"{tools}:{run_env['PATH']}", FAKE_ARCH=arch, **env)
    return subprocess.run(["bash", str(ROOT / "setup_env.sh")], env=run_env, capture_output=True,
                          text=True, timeout=60)


def pip_calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "venv" / "state" / "pip.log").read_text().splitlines()


def test_on_a_gpu_node_it_installs_the_cuda_build_from_pypi_and_checks_torch_can_use_the_gpu(
        tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="13.0")
    assert done.returncode == 0, done.stderr
    assert "torch variant 'cuda' (x86_64)" in done.stdout
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
    if subprocess.run(["bash", "-c", "command -v nvidia-smi || command -v rocm-smi"],
                      capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi or rocm-smi: setup_env.sh would pick a GPU build")
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


def test_on_an_amd_gpu_node_it_installs_the_rocm_build_and_checks_torch_can_use_the_gpu(tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="7.1", tool="rocm-smi")
    assert done.returncode == 0, done.stderr
    assert "torch variant 'rocm' (x86_64)" in done.stdout
    assert pip_calls(tmp_path)[0] == ("--disable-pip-version-check install torch==2.13.0 "
                                      "--index-url https://download.pytorch.org/whl/rocm7.1")
    assert "setup_env: torch 2.13.0+rocm7.1, CUDA available: True" in done.stdout


def test_a_rocm_build_newer_than_the_node_s_rocm_stops_with_one_line_naming_both_and_the_fix(
        tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="6.4", tool="rocm-smi", TORCH_VARIANT="rocm")
    assert done.returncode == 1
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith("setup_env: error: torch 2.13.0+rocm7.1 is built for ROCm 7.1 but "
                           "cannot use the GPU that rocm-smi sees (its Driver version: 6.4): ")
    assert "TORCH_VARIANT=rocm TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4" in line


def test_torch_index_url_picks_the_rocm_build_of_the_node_s_rocm(tmp_path):
    url = "https://download.pytorch.org/whl/rocm6.4"
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="6.4", tool="rocm-smi", TORCH_INDEX_URL=url)
    assert done.returncode == 0, done.stderr
    assert pip_calls(tmp_path)[0].endswith(f"install torch==2.13.0 --index-url {url}")


def test_the_rocm_build_replaces_a_cuda_or_cpu_build_made_before(tmp_path):
    (tmp_path / "venv" / "state").mkdir(parents=True)
    (tmp_path / "venv" / "state" / "torch").write_text("2.13.0+cu130 13.0 False None\n")
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="7.1", tool="rocm-smi")
    assert done.returncode == 0, done.stderr
    assert pip_calls(tmp_path)[0] == "--disable-pip-version-check uninstall -y -q torch"
    assert "setup_env: torch 2.13.0+rocm7.1, CUDA available: True" in done.stdout


def test_on_a_grace_hopper_node_it_installs_pypi_s_aarch64_cuda_build(tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="13.0", arch="aarch64")
    assert done.returncode == 0, done.stderr
    assert "torch variant 'cuda' (aarch64)" in done.stdout
    assert pip_calls(tmp_path)[0] == "--disable-pip-version-check install torch==2.13.0"
    assert "CUDA available: True" in done.stdout


def test_a_cpu_only_torch_on_a_grace_hopper_node_stops_with_a_line_that_says_so(tmp_path):
    """An index without aarch64 CUDA builds (or an old pin) gives a CPU-only torch there."""
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="13.0", arch="aarch64", TORCH_VARIANT="cuda",
                               TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert done.returncode == 1
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith("setup_env: error: torch 2.13.0+cpu is a CPU-only build for aarch64, "
                           "on a node whose GPU nvidia-smi sees (its driver: CUDA Version: 13.0)")


def test_rocm_on_an_aarch64_node_stops_before_installing_anything(tmp_path):
    done = setup_on_a_gpu_node(tmp_path, driver_cuda="7.1", tool="rocm-smi", arch="aarch64",
                               TORCH_VARIANT="rocm")
    assert done.returncode == 1
    assert done.stderr.strip() == ("setup_env: TORCH_VARIANT=rocm: PyTorch's ROCm builds are for "
                                   "x86_64 nodes, this one is aarch64")
    assert not (tmp_path / "venv" / "state" / "pip.log").exists()
