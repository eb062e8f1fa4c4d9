#!/usr/bin/env bash
# Create the course's Python environment and prepare WikiText-2. Safe to run again.
#
#   bash setup_env.sh
#
# Knobs (environment variables):
#   TORCH_VARIANT=auto|cpu|cuda|rocm|module
#       auto (default): cuda when `nvidia-smi` sees a GPU, rocm when `rocm-smi` (or `amd-smi`)
#               sees an AMD GPU, else cpu.
#       cpu:    the CPU wheel of torch 2.13.0 (small; laptops, CI, CPU-only test nodes).
#       cuda:   the CUDA build of torch 2.13.0 from PyPI (several GB; GPU clusters), on x86_64
#               and on aarch64 (Grace Hopper: PyPI's aarch64 wheel is the CUDA build). PyPI's
#               build needs a recent NVIDIA driver; for an older one pick a build for the
#               driver's CUDA version (`nvidia-smi` shows it) with TORCH_INDEX_URL, e.g.
#               TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
#       rocm:   the ROCm build of torch 2.13.0 for AMD GPUs (MI250X, MI300X) from PyTorch's
#               ROCm index (x86_64 only); TORCH_INDEX_URL picks another ROCm version, the one
#               nearest the node's (`rocm-smi --showdriverversion`, /opt/rocm/.info/version).
#               Centres such as LUMI recommend their PyTorch container instead: sites/lumi.env.
#       module: keep the torch you loaded before (e.g. `module load PyTorch` on a JSC system);
#               the environment then sees the system's packages.
#   TORCH_INDEX_URL where torch comes from (cpu default: PyTorch's CPU wheel index; cuda
#               default: PyPI; rocm default: $ROCM_INDEX_URL below).
#   VENV=path       where the environment goes (default: .venv in the repository).
#   PYTHON=python3  the interpreter that creates it.
#   SKIP_DATA=1     do not try to download WikiText-2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
# PyTorch's index of ROCm builds of that version (the ROCm it was released with).
ROCM_INDEX_URL=https://download.pytorch.org/whl/rocm7.1
arch=$(uname -m)
# The GPUs of this node as their vendors' tools see them (none: a login node or a CPU node).
nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# (grep reads to the end, not -q: under pipefail an early exit would fail the writer with SIGPIPE)
amd_gpu() {
    { command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showproductname 2>/dev/null | grep 'GPU\[' >/dev/null; } ||
        { command -v amd-smi >/dev/null 2>&1 && amd-smi list 2>/dev/null | grep '^GPU' >/dev/null; }
}
variant=${TORCH_VARIANT:-auto}
if [ "$variant" = auto ]; then
    if nvidia_gpu; then
        variant=cuda
    elif amd_gpu; then
        variant=rocm
    else
        variant=cpu
        if command -v sbatch >/dev/null 2>&1; then  # a cluster's login node, most likely
            echo "setup_env: note: no GPU here, so the CPU build of torch; for this cluster's GPU nodes use TORCH_VARIANT=cuda bash setup_env.sh (AMD GPUs: TORCH_VARIANT=rocm; or TORCH_VARIANT=module)"
        fi
    fi
fi
if [ "$variant" = rocm ] && [ "$arch" != x86_64 ]; then
    echo "setup_env: TORCH_VARIANT=rocm: PyTorch's ROCm builds are for x86_64 nodes, this one is $arch" >&2; exit 1
fi
echo "setup_env: torch variant '$variant' ($arch), environment $VENV"

if [ ! -x "$VENV/bin/python" ]; then
    if [ "$variant" = module ]; then
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# The installed torch's version, read without importing torch: before NumPy is installed (by
# requirements.txt below) an import prints "Failed to initialize NumPy" on a fresh environment.
torch_version() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
installed_torch=$(torch_version || true)
case "$variant" in
    module)
        [ -n "$installed_torch" ] || { echo "setup_env: TORCH_VARIANT=module but no torch is importable: load your PyTorch module first" >&2; exit 1; }
        ;;
    cpu)
        if [[ "$installed_torch" != "$TORCH_VERSION"* ]]; then
            # PyPI's Linux wheel is the CUDA build (several GB); PyTorch's own CPU index has the
            # small one. A CPU wheel that pip already finds locally (find-links, a wheelhouse,
            # as on CI machines) is used without asking any index.
            if pip install --dry-run --quiet --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
                pip install "torch==$TORCH_VERSION"
            else
                pip install "torch==$TORCH_VERSION" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
            fi
        fi
        ;;
    cuda | rocm)
        # An environment made before with another build (the CPU one on a login node, say):
        # pip would call 2.13.0+cpu good enough for torch==2.13.0, so remove it first.
        # PyPI's CUDA build has no local version (2.13.0); the ROCm ones end in +rocm<version>.
        if [[ "$installed_torch" == *+cpu ]] ||
                { [ "$variant" = cuda ] && [[ "$installed_torch" == *+rocm* ]]; } ||
                { [ "$variant" = rocm ] && [[ -n "$installed_torch" && "$installed_torch" != *+rocm* ]]; }; then
            pip uninstall -y -q torch
            installed_torch=
        fi
        index=${TORCH_INDEX_URL:-}
        if [ "$variant" = rocm ]; then index=${index:-$ROCM_INDEX_URL}; fi
        if [[ "$installed_torch" != "$TORCH_VERSION"* ]]; then
            pip install "torch==$TORCH_VERSION" ${index:+--index-url "$index"}
        fi
        ;;
    *)
        echo "setup_env: TORCH_VARIANT must be auto, cpu, cuda, rocm or module, not '$variant'" >&2; exit 1
        ;;
esac

# The torch now installed satisfies the other packages: keep it (never pull a second build).
torch_now=$(torch_version)
torch_now=${torch_now%%+*}
pip install -q -r requirements.txt "torch==$torch_now"
pip install -q --no-deps -e .
"$VENV/bin/python" -c 'import torch, model, utils; print(f"setup_env: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")'
# A GPU that nvidia-smi (or rocm-smi) sees but torch cannot use: most often a driver older than
# the CUDA (ROCm) that torch was built for, or a CPU-only build (an old torch on aarch64, where
# PyPI had no CUDA builds). Without this check every script would quietly train on the CPU.
gpu_tool=''
if [ "$variant" = cuda ] && nvidia_gpu; then gpu_tool=nvidia-smi; fi
if [ "$variant" = rocm ] && amd_gpu; then gpu_tool=rocm-smi; fi
if [ -n "$gpu_tool" ]; then
    read -r usable cuda hip < <("$VENV/bin/python" -W ignore -c 'import torch; print(torch.cuda.is_available(), torch.version.cuda, torch.version.hip)')
    if [ "$usable" != True ]; then
        torch_is="torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
        if [ "$gpu_tool" = nvidia-smi ]; then
            driver=$(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | sed -n 1p || true)
            if [ "$cuda" = None ]; then
                echo "setup_env: error: $torch_is is a CPU-only build for $arch, on a node whose GPU nvidia-smi sees (its driver: ${driver:-CUDA version unknown}): install a CUDA build, e.g. rm -rf $VENV; TORCH_VARIANT=cuda bash setup_env.sh (aarch64: PyPI's torch $TORCH_VERSION is the CUDA build; an index without aarch64 CUDA builds gives a CPU one)" >&2
            else
                echo "setup_env: error: $torch_is is built for CUDA $cuda but cannot use the GPU that nvidia-smi sees (its driver: ${driver:-CUDA version unknown}): install a build for that CUDA version, e.g. rm -rf $VENV; TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash setup_env.sh (or TORCH_VARIANT=module with your centre's PyTorch module)" >&2
            fi
        else
            driver=$(rocm-smi --showdriverversion 2>/dev/null | grep -io 'driver version: [^ ]*' | sed -n 1p || true)
            echo "setup_env: error: $torch_is is built for ROCm $hip but cannot use the GPU that rocm-smi sees (its ${driver:-driver version unknown}): install a build for the node's ROCm, e.g. rm -rf $VENV; TORCH_VARIANT=rocm TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4 bash setup_env.sh (or the centre's PyTorch container: sites/lumi.env, docs/containers.md)" >&2
        fi
        exit 1
    fi
fi

if [ "${SKIP_DATA:-0}" != 1 ]; then
    "$VENV/bin/python" prepare_data.py || true
fi
echo "setup_env: done. Activate with: source $VENV/bin/activate"
