# shellcheck shell=bash
# Reading a site profile: sourced by sites/sbatch (on the login node) and sites/job.sh (in the job).
#
# SITE names the profile: a name (SITE=lumi reads sites/lumi.env) or the path of a .env file
# kept anywhere (SITE=$HOME/mysite.env). Without SITE: jsc, the site the job files' own
# #SBATCH values are written for. A SITE_* variable exported in the environment wins over the
# profile's line (SITE_PARTITION=dc-gpu-devel sites/sbatch ...: one job in another partition).

# The site the job files' #SBATCH lines are written for (sites/sbatch translates from it).
SITE_DEFAULT=jsc

# site_profile_path: the profile file that SITE names, or an error line and status 1.
site_profile_path() {
    local name=${SITE:-$SITE_DEFAULT} root file
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    case $name in
        */* | *.env) file=$name ;;
        *) file=$root/sites/$name.env ;;
    esac
    if [ ! -f "$file" ]; then
        local known
        # shellcheck disable=SC2012  # the names of sites/*.env, no odd characters
        known=$(cd "$root/sites" && ls -- *.env 2>/dev/null | sed 's/\.env$//' | tr '\n' ' ')
        echo "error: no site profile $file (SITE=$name): use one of: ${known% }, or the path" \
            "of your own .env file (copy sites/generic.env; docs/sites.md)" >&2
        return 1
    fi
    (cd "$(dirname "$file")" && echo "$(pwd)/$(basename "$file")")
}

# site_load: read the profile into SITE_* shell variables (not exported), SITE_PROFILE its path.
site_load() {
    local file overrides
    file=$(site_profile_path) || return 1
    # What the environment sets wins: keep the exported SITE_* values, restore them after
    # (declare -g: a plain declare in a function would make them local to it).
    overrides=$(export -p | sed -n 's/^declare -x \(SITE_[A-Z0-9_]*=\)/declare -gx \1/p')
    # shellcheck source=/dev/null
    source "$file"
    eval "$overrides"
    # shellcheck disable=SC2034  # read by sites/sbatch and sites/job.sh
    SITE_PROFILE=$file
    # shellcheck disable=SC2034
    SITE_NAME=$(basename "$file" .env)
    local v
    for v in SITE_GPUS_PER_NODE SITE_CPUS_PER_GPU; do
        if ! [[ ${!v:-} =~ ^[1-9][0-9]*$ ]]; then
            echo "error: $file: $v must be a whole number (now '${!v:-}')" >&2
            return 1
        fi
    done
}
