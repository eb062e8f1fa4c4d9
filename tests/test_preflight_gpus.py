"""preflight.sbatch's GPU lines (tools/preflight.py) on NVIDIA and AMD nodes, with stand-ins for
nvidia-smi and rocm-smi on PATH and torch's build (CUDA, ROCm or CPU-only) set by hand."""

import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import preflight  # noqa: E402

SMI = {
    "nvidia-smi": '#!/bin/bash\necho "560.35.03"\n',
    "rocm-smi": '#!/bin/bash\n[ "$1" = --showdriverversion ] && echo "Driver version: 6.8.5"\n',
}


@pytest.fixture
def node(tmp_path, monkeypatch):
    """node(tool, cuda=..., hip=...): a node whose GPUs `tool` sees, torch built for cuda/hip."""
    def make(tool, cuda=None, hip=None):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        if tool:
            (bin_dir / tool).write_text(SMI[tool])
            (bin_dir / tool).chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", hip, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        return {check: (status, detail) for status, check, _, detail in preflight.gpu_lines("n1")}
    return make


def test_an_amd_node_with_a_cuda_or_cpu_torch_fails_with_the_rocm_variant_as_the_fix(node):
    status, detail = node("rocm-smi")["CUDA, driver, NCCL"]
    assert status == "FAIL"
    assert detail == (f"torch {torch.__version__} is a CPU-only build, on a node with AMD driver "
                      "6.8.5: make the environment with TORCH_VARIANT=rocm bash setup_env.sh")
    status, detail = node("rocm-smi", cuda="13.0")["CUDA, driver, NCCL"]
    assert status == "FAIL" and "is built for CUDA 13.0, on a node with AMD driver" in detail


def test_an_amd_node_with_a_rocm_torch_reports_rocm_and_rccl(node, monkeypatch):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 22, 3))
    lines = node("rocm-smi", hip="7.1.25424")
    status, detail = lines["CUDA, driver, NCCL"]
    assert status == "PASS" and detail.startswith("ROCm 7.1.25424, driver 6.8.5, RCCL ")
    status, detail = lines["GPUs visible"]  # torch.cuda.is_available() is False here
    assert status == "FAIL" and detail.startswith("torch sees no GPU (driver 6.8.5, ROCm 7.1")


def test_an_nvidia_node_with_a_rocm_torch_names_the_cuda_variant(node):
    status, detail = node("nvidia-smi", hip="7.1.25424")["CUDA, driver, NCCL"]
    assert status == "FAIL" and detail.endswith(
        "is built for ROCm 7.1.25424, on a node with NVIDIA driver 560.35.03: make the "
        "environment with TORCH_VARIANT=cuda bash setup_env.sh")


def test_a_node_without_either_tool_is_a_cpu_node(node):
    lines = node(None)
    assert lines["CUDA, driver, NCCL"][0] == lines["GPUs visible"][0] == "N/A"
    assert lines["GPUs visible"][1].startswith("no GPU driver on this node (nvidia-smi, rocm-smi)")
