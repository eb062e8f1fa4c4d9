# shellcheck shell=bash
# The site profile inside a job: every job file sources this right after its check that it runs
# under Slurm (`source sites/job.sh`, from the repository root, where jobs are submitted).
#
# It reads sites/$SITE.env (sites/lib.sh; default jsc), runs the profile's site_job_setup
# (modules, network variables), and sets up Python: the venv made by setup_env.sh, or the
# profile's Apptainer image, in which case python, torchrun, nsys and rocprofv3 (sites/bin)
# run inside it. What the job files read from here:
#   SITE_GPU_IDS     the GPU numbers of a whole node, 0,1,2,3 for 4 GPUs (CUDA_VISIBLE_DEVICES)
#   SITE_IB_SUFFIX   the suffix that makes a node's name the name of its fast-network
#                    interface: i at JSC (jrc0001i, InfiniBand), empty elsewhere
#   SITE_DATA_CACHE  where prepare_data.py's cache is (COURSE_DATA_CACHE overrides)
#   SITE_RUNS_DIR    where the runs are written (OUT_DIR overrides for one job)
# and SITE_EXPECT_INTRA_BUSBW / SITE_EXPECT_INTER_BUSBW (preflight.sbatch). docs/sites.md.

COURSE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=sites/lib.sh
source "$COURSE_ROOT/sites/lib.sh"
site_load || exit 1

if declare -F site_job_setup >/dev/null; then
    # Lmod's `module` and many centres' setup scripts read unset variables: no set -u here.
    set +u
    site_job_setup
    set -u
fi

SITE_GPU_IDS=${SITE_GPU_IDS:-$(seq -s, 0 $((SITE_GPUS_PER_NODE - 1)))}
SITE_IB_SUFFIX=${SITE_IB_SUFFIX:-}
SITE_DATA_CACHE=${SITE_DATA_CACHE:-$SLURM_SUBMIT_DIR/data_cache}
SITE_RUNS_DIR=${SITE_RUNS_DIR:-$SLURM_SUBMIT_DIR/runs}
SITE_EXPECT_INTRA_BUSBW=${SITE_EXPECT_INTRA_BUSBW:-200}
SITE_EXPECT_INTER_BUSBW=${SITE_EXPECT_INTER_BUSBW:-60}

# A job submitted with plain sbatch has the job file's own #SBATCH values (JSC's), whatever
# SITE says: say so when they do not match the profile.
if [ -n "${SLURM_JOB_PARTITION:-}" ] && [ -n "${SITE_PARTITION:-}" ] &&
        [ "$SLURM_JOB_PARTITION" != "$SITE_PARTITION" ]; then
    echo "warning: this job runs in partition $SLURM_JOB_PARTITION, but $SITE_PROFILE says" \
        "$SITE_PARTITION: submit with the profile, SITE=$SITE_NAME sites/sbatch <job file>" >&2
fi

if [ -n "${SITE_CONTAINER:-}" ]; then
    SITE_APPTAINER=${SITE_APPTAINER:-apptainer}
    if [ ! -f "$SITE_CONTAINER" ]; then
        echo "error: the container $SITE_CONTAINER ($SITE_PROFILE) does not exist: build it with" \
            "$SITE_APPTAINER build (sites/course.def, docs/containers.md) or set SITE_CONTAINER" >&2
        exit 1
    fi
    if ! command -v "$SITE_APPTAINER" >/dev/null 2>&1; then
        echo "error: $SITE_PROFILE runs the course in $SITE_CONTAINER, but there is no" \
            "$SITE_APPTAINER command here: load its module in site_job_setup, or set" \
            "SITE_APPTAINER=singularity" >&2
        exit 1
    fi
    # The image holds torch and the course's packages; model/ and utils/ come from this
    # repository, which sites/bin binds into the container with the data cache and the runs.
    export PYTHONPATH=$COURSE_ROOT${PYTHONPATH:+:$PYTHONPATH}
    export SITE_CONTAINER SITE_APPTAINER SITE_CONTAINER_OPTIONS=${SITE_CONTAINER_OPTIONS:-}
    export SITE_CONTAINER_BINDS=${SITE_CONTAINER_BINDS:-} SITE_RUNS_DIR COURSE_ROOT
    python_is="$SITE_CONTAINER ($SITE_APPTAINER $SITE_CONTAINER_OPTIONS)"
else
    venv=${VENV:-${SITE_VENV:-$SLURM_SUBMIT_DIR/.venv}}
    # The venv's Python must suit this node's CPU: one made on an x86 login node does not run
    # on Grace (aarch64) nodes. The ELF header says which (e_machine: 0x3e x86_64, 0xb7 aarch64).
    python_bin=$(readlink -f "$venv/bin/python" 2>/dev/null || true)
    if [ -f "$python_bin" ] && [ "$(head -c 4 "$python_bin" | tail -c 3)" = ELF ]; then
        case $(od -An -t x1 -j 18 -N 2 "$python_bin" | tr -d ' \n') in
            3e00) built=x86_64 ;;
            b700) built=aarch64 ;;
            *) built=$(uname -m) ;;
        esac
        if [ "$built" != "$(uname -m)" ]; then
            echo "error: the Python environment $venv is built for $built, but this node is" \
                "$(uname -m): make one on a $(uname -m) node (bash setup_env.sh there, with" \
                "VENV=<another folder>) and set SITE_VENV in $SITE_PROFILE" >&2
            exit 1
        fi
    fi
    # shellcheck source=/dev/null
    source "$venv/bin/activate"
    python_is=$venv
    unset venv python_bin built
fi
if [ -n "${SITE_CONTAINER:-}" ] || [ -n "${SITE_TORCHRUN_OPTIONS:-}" ]; then
    export SITE_TORCHRUN_OPTIONS=${SITE_TORCHRUN_OPTIONS:-}
    export PATH=$COURSE_ROOT/sites/bin:$PATH
fi
echo "site: $SITE_NAME ($SITE_PROFILE): $SITE_GPUS_PER_NODE GPUs and" \
    "$((SITE_GPUS_PER_NODE * SITE_CPUS_PER_GPU)) cores per node, rendezvous at" \
    "<node>$SITE_IB_SUFFIX, Python from $python_is"
unset python_is
