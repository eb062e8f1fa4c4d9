"""The sbatch files, run by bash with stand-ins for the Slurm and DNS commands on PATH.

(tests/test_slurm_jobs.py submits the same files to a real Slurm cluster.)
"""

import os
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

SBATCH_FILES = sorted(ROOT.glob("*.sbatch")) + sorted((ROOT / "solutions").glob("*.sbatch"))

STUBS = {
    # scontrol show hostnames <list>: one name per line, from $FAKE_NODES
    "scontrol": 'for n in $FAKE_NODES; do echo "$n"; done',
    # nslookup NAME: the answer format of BIND's nslookup, for names listed in $FAKE_DNS
    "nslookup": '''for entry in $FAKE_DNS; do
  if [ "${entry%%=*}" = "$1" ]; then
    printf 'Server:\\t\\t127.0.0.53\\nAddress:\\t127.0.0.53#53\\n\\nName:\\t%s\\nAddress: %s\\n' "$1" "${entry#*=}"
    exit 0
  fi
done
printf "** server can't find %s: NXDOMAIN\\n" "$1"; exit 1''',
    # srun: run the command once per node of $FAKE_NODES with SLURM_NODEID set
    "srun": '''printf "%s\\n" "$@" > "$FAKE_LOG/srun.args"
while [ "${1#-}" != "$1" ]; do shift; done
i=0; for n in $FAKE_NODES; do SLURM_NODEID=$i "$@"; i=$((i + 1)); done''',
    "torchrun": 'printf "%s\\n" "$@" > "$FAKE_LOG/torchrun.$SLURM_NODEID"',
    "python": 'printf "%s\\n" "$@" > "$FAKE_LOG/python.$SLURM_NODEID"',
}


@pytest.fixture
def fake_cluster(tmp_path):
    bin_dir, log, venv = tmp_path / "bin", tmp_path / "log", tmp_path / "venv"
    for d in (bin_dir, log, venv / "bin"):
        d.mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    for name, body in STUBS.items():
        f = bin_dir / name
        f.write_text(f"#!/bin/bash\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)

    def submit(sbatch, *args, nodes=("jrc0001",), dns=(), **env):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
        full_env.update(
            PATH=f"{bin_dir}:{os.environ['PATH']}", VENV=str(venv), FAKE_LOG=str(log),
            FAKE_NODES=" ".join(nodes), FAKE_DNS=" ".join(f"{k}={v}" for k, v in dns),
            SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NAME="job", SLURM_JOB_ID="4242",
            SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_NUM_NODES=str(len(nodes)),
            SLURM_CPUS_PER_TASK="32", **env)
        proc = subprocess.run(["bash", str(ROOT / sbatch), *args], cwd=ROOT, env=full_env,
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        launched = {f.name: f.read_text().splitlines() for f in log.iterdir()}
        return proc.stdout, launched

    submit.tmp = tmp_path
    return submit


@pytest.mark.parametrize("sbatch", SBATCH_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_sbatch_file_is_valid_bash(sbatch):
    subprocess.run(["bash", "-n", str(sbatch)], check=True, timeout=10)


@pytest.mark.parametrize("sbatch", SBATCH_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_sbatch_file_fails_on_errors_and_takes_its_site_settings_from_the_profile(sbatch):
    """A centre edits its profile (sites/*.env), not eight job files: nothing here says EDIT."""
    text = sbatch.read_text()
    assert "set -euo pipefail" in text
    assert "\nsource sites/job.sh\n" in text
    assert "EDIT" not in text
    assert "--reservation" not in "\n".join(l for l in text.splitlines() if l.startswith("#SBATCH"))


def test_the_exercise_runs_one_training_process_with_the_extra_arguments(fake_cluster):
    out, launched = fake_cluster("to_distributed_training.sbatch", "--max-steps", "5")
    args = launched["python.0"]
    assert args[:2] == ["-u", "train/to_distributed_training.py"]
    assert args[-2:] == ["--max-steps", "5"]
    out_dir = Path(args[args.index("--out-dir") + 1])
    assert out_dir == fake_cluster.tmp / "runs" / "job-4242" and out_dir.is_dir()


def test_the_master_is_the_infiniband_address_of_the_first_node(fake_cluster):
    out, launched = fake_cluster(
        "solutions/to_distributed_training.sbatch", nodes=("jrc0001", "jrc0002"),
        dns=(("jrc0001i", "10.10.0.1"), ("jrc0002i", "10.10.0.2")))
    assert "MASTER_ADDR=10.10.0.1 MASTER_PORT=24242" in out
    assert "--rdzv_endpoint=10.10.0.1:24242" in launched["torchrun.0"]
    assert "--rdzv_endpoint=10.10.0.1:24242" in launched["torchrun.1"]


def test_without_an_infiniband_name_the_plain_host_name_is_the_master(fake_cluster):
    out, launched = fake_cluster("solutions/to_distributed_training.sbatch", nodes=("gpu17",))
    assert "MASTER_ADDR=gpu17 " in out
    assert "--rdzv_endpoint=gpu17:24242" in launched["torchrun.0"]


def test_two_nodes_get_one_torchrun_each_and_only_node_0_hosts_the_rendezvous(fake_cluster):
    _, launched = fake_cluster("solutions/to_distributed_training.sbatch", "--epochs", "1",
                               nodes=("jrc0001", "jrc0002"))
    node0, node1 = launched["torchrun.0"], launched["torchrun.1"]
    common = ["--nnodes=2", "--nproc_per_node=gpu", "--rdzv_backend=c10d", "--rdzv_id=4242"]
    assert node0[:4] == node1[:4] == common
    assert "--rdzv_conf=is_host=1" in node0 and "--rdzv_conf=is_host=0" in node1
    script = node0.index("train/to_distributed_training.py")
    assert node0[script + 1:] == node1[script + 1:]
    assert node0[-2:] == ["--epochs", "1"] and "--dataset" in node0 and "wikitext-2" in node0


def test_one_node_runs_one_torchrun_with_all_its_gpus(fake_cluster):
    _, launched = fake_cluster("solutions/to_distributed_training.sbatch")
    assert {name for name in launched if name.startswith("torchrun")} == {"torchrun.0"}
    assert launched["torchrun.0"][:2] == ["--nnodes=1", "--nproc_per_node=gpu"]
    assert "--rdzv_conf=is_host=1" in launched["torchrun.0"]


def test_on_cpu_only_nodes_the_process_count_comes_from_nproc_per_node(fake_cluster):
    _, launched = fake_cluster("solutions/to_distributed_training.sbatch", NPROC_PER_NODE="2")
    assert "--nproc_per_node=2" in launched["torchrun.0"]


def test_srun_hands_the_cpus_of_the_job_to_the_training_processes(fake_cluster):
    """Since Slurm 22.05 srun does not inherit --cpus-per-task: without it, one core."""
    for sbatch in ("to_distributed_training.sbatch", "solutions/to_distributed_training.sbatch"):
        _, launched = fake_cluster(sbatch)
        assert "--cpus-per-task=32" in launched["srun.args"]
