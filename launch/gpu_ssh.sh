#!/usr/bin/env bash
# Run `rljax train` on several GPU hosts over plain SSH: one process per host, owning its GPUs.
#
#   launch/gpu_ssh.sh --hosts HOST0,HOST1[,...] [options] [-- TRAIN_ARGS...]
#   launch/gpu_ssh.sh --hosts HOST0,HOST1[,...] [--workdir DIR] --stop
#
# Steps: install rljax on every host, check that every host has the same python/jax/jaxlib/rljax,
# then run `python3 -m rljax train TRAIN_ARGS` on every host, streaming each host's output
# prefixed with its index. Ctrl-C (or SIGTERM), or one host's run failing, stops the runs on
# every host. output_dir must be a path every host sees (a shared filesystem) or a gs:// bucket:
# the hosts write one checkpoint together.
#
# Options:
#   --hosts LIST     comma-separated SSH hosts; the first one runs the coordinator (required)
#   --port PORT      coordinator port on the first host (default 12355)
#   --workdir DIR    directory on every host to install and run in, created if missing; relative
#                    to the remote home (default: the remote home)
#   --activate FILE  script to source first on every host (relative to the workdir), e.g. a venv's
#                    bin/activate; the install goes into that environment
#   --wheel PATH     the rljax wheel to install (default: built from this checkout with
#                    `pip wheel --no-deps` into build/launch/); copied to every host with scp
#   --pip-spec SPEC  install rljax from a pip spec you control instead (a git URL); never "rljax"
#                    from PyPI, which is another project
#   --jax SPEC       pip spec for jax, installed with rljax (default "jax[cuda12]>=0.10.2,<0.11";
#                    "" keeps the hosts' jax)
#   --no-install     skip the install: the hosts already have this rljax
#   --check-only     only check that every host has the same versions (no install, no training)
#   --stop           stop the runs an earlier invocation started (detached, or killed with -9)
#   --dry-run        print the exact commands instead of running them
#
# Process i gets RLJAX_COORDINATOR_ADDRESS=HOST0:PORT, RLJAX_NUM_PROCESSES=N and
# RLJAX_PROCESS_ID=i, which `rljax train` passes to jax.distributed.initialize; a host that cannot
# reach HOST0:PORT within RLJAX_INIT_TIMEOUT seconds (default 300) fails with one line. Each run
# is its own process group (setsid) whose id, with this invocation's run id, is kept in
# rljax-train.pid in the workdir: stopping kills the whole group on its host, not just the local
# ssh, and a failing invocation stops only its own runs. A host where a run is still going
# refuses a new one. Needs bash >= 4.4 (macOS: a newer bash than /bin/bash).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

hosts="" port=12355 workdir="" activate="" wheel="" pip_spec="" jax_spec="jax[cuda12]>=0.10.2,<0.11"
install=1 check_only=0 stop_only=0 dry_run=0
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hosts) hosts="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --activate) activate="$2"; shift 2 ;;
    --wheel) wheel="$2"; shift 2 ;;
    --pip-spec) pip_spec="$2"; shift 2 ;;
    --jax) jax_spec="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --check-only) check_only=1; install=0; shift ;;
    --stop) stop_only=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "gpu_ssh.sh: unknown option '$1'; see launch/gpu_ssh.sh --help" >&2; exit 2 ;;
  esac
done
[[ -n "$hosts" ]] || { echo "gpu_ssh.sh: --hosts is required (e.g. --hosts gpu0,gpu1)" >&2; exit 2; }

# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
refuse_pypi_rljax gpu_ssh.sh "$pip_spec" || exit 2

IFS=, read -r -a host_list <<<"$hosts"
coordinator="${host_list[0]#*@}"  # the first host, without a user@ prefix
ssh_opts=(-o BatchMode=yes)

in_workdir=""  # every remote command starts in the workdir
[[ -n "$workdir" ]] && in_workdir="cd $(quote "$workdir") && "
prefix="$in_workdir"
[[ -n "$activate" ]] && prefix+="source $(quote "$activate") && "

# Starts `$1 INDEX HOST` for every host at once, each output line prefixed with [INDEX]; their
# jobs go to `jobs_started`. In dry-run mode, runs them one after another (printing commands).
start_on_hosts() {
  local i
  jobs_started=()
  for i in "${!host_list[@]}"; do
    if [[ "$dry_run" == 1 ]]; then "$1" "$i" "${host_list[$i]}"; continue; fi
    { "$1" "$i" "${host_list[$i]}" 2>&1 | sed -u "s/^/[$i] /"; } &
    jobs_started+=("$!")
  done
}

install_on() {
  local host="$2" jax_arg=""
  [[ -n "$jax_spec" ]] && jax_arg=" $(quote "$jax_spec")"
  if [[ -n "$pip_spec" ]]; then
    run ssh "${ssh_opts[@]}" "$host" "${prefix}python3 -m pip install --upgrade$jax_arg $(quote "$pip_spec")"
    return
  fi
  if [[ -n "$workdir" ]]; then run ssh "${ssh_opts[@]}" "$host" "mkdir -p $(quote "$workdir")"; fi
  run scp -q "${ssh_opts[@]}" "$wheel" "$host:${workdir:+$workdir/}"
  run ssh "${ssh_opts[@]}" "$host" \
    "${prefix}python3 -m pip install --upgrade$jax_arg $(quote "./$(basename "$wheel")[gcs]")"
}

install() {
  if [[ -z "$pip_spec" && -z "$wheel" ]]; then
    checkout_wheel "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" gpu_ssh.sh || exit 2
  fi
  if [[ "$dry_run" == 0 && -z "$pip_spec" && ! -f "$wheel" ]]; then
    echo "gpu_ssh.sh: no wheel at $wheel; pass --wheel PATH" >&2; exit 2
  fi
  start_on_hosts install_on
  local job status=0
  for job in "${jobs_started[@]}"; do wait "$job" || status=1; done
  if [[ "$status" != 0 ]]; then
    echo "gpu_ssh.sh: installing rljax failed on a host (its [i] lines above); fix that host, or" \
      "pass --no-install if every host already has this rljax" >&2
    exit 1
  fi
}

check() {
  local host
  for host in "${host_list[@]}"; do
    run ssh "${ssh_opts[@]}" "$host" "${prefix}python3 -c '$versions_py'"
  done
}

# Kills the run's process group on one host (TERM, then KILL after 10 s) and removes its pid
# file: the group this invocation started (run_id), or with --stop whichever run is recorded.
# shellcheck disable=SC2016  # $pg, $id and $n expand on the host
stop_on() {
  run ssh "${ssh_opts[@]}" "$2" "${in_workdir}"'if [ -f rljax-train.pid ]; then read -r pg id < rljax-train.pid;'\
" if [ -z '$run_id' ] || [ \"\$id\" = '$run_id' ]; then"\
' kill -s TERM -- -$pg 2>/dev/null || kill -s TERM $pg 2>/dev/null; n=0;'\
' while kill -0 -- -$pg 2>/dev/null && [ $n -lt 10 ]; do sleep 1; n=$((n + 1)); done;'\
' kill -s KILL -- -$pg 2>/dev/null; rm -f rljax-train.pid; echo "stopped process group $pg"; fi; fi'
}

stop_all() {
  start_on_hosts stop_on
  local job
  for job in "${jobs_started[@]}"; do wait "$job" || true; done
}

# Runs training on one host as its own process group (setsid), which stop_on kills with any
# children it has; "PGID RUN_ID" goes to rljax-train.pid. Refuses to start beside a live run.
# shellcheck disable=SC2016  # $!, $pg and $status expand on the host
train_on() {
  local i="$1" host="$2" quoted="" arg
  for arg in "${train_args[@]}"; do quoted+=" $(quote "$arg")"; done
  local env_vars="RLJAX_COORDINATOR_ADDRESS=$coordinator:$port RLJAX_NUM_PROCESSES=${#host_list[@]} RLJAX_PROCESS_ID=$i"
  run ssh "${ssh_opts[@]}" "$host" "${prefix}"'{ if [ -f rljax-train.pid ] && read -r pg _ < rljax-train.pid'\
' && kill -0 -- -$pg 2>/dev/null; then echo "gpu_ssh.sh: an earlier run is still running here; stop it with'\
' launch/gpu_ssh.sh --stop (same --hosts and --workdir)" >&2; exit 3; fi;'\
" env $env_vars setsid python3 -m rljax train$quoted < /dev/null 2>&1 & echo \"\$! $run_id\" > rljax-train.pid;"\
' wait $!; status=$?; rm -f rljax-train.pid; exit $status; }'
}

# Stops every host's run and exits with $1, once the local ssh sessions have ended.
stop_and_exit() {
  trap - INT TERM
  stop_all
  wait
  exit "$1"
}

run_id=""  # --stop: whichever run is recorded
if [[ "$stop_only" == 1 ]]; then stop_all; exit 0; fi
run_id="$(date +%s).$$"  # marks this invocation's runs, so a failure here stops only those
if [[ "$install" == 1 ]]; then install; fi
if [[ "$dry_run" == 1 ]]; then check; else check | same_versions; fi
[[ "$check_only" == 1 ]] && exit 0

if [[ "$dry_run" == 1 ]]; then start_on_hosts train_on; exit 0; fi
trap 'echo "gpu_ssh.sh: interrupted; stopping the runs on every host" >&2; stop_and_exit 130' INT
trap 'echo "gpu_ssh.sh: terminated; stopping the runs on every host" >&2; stop_and_exit 143' TERM
start_on_hosts train_on
for _ in "${jobs_started[@]}"; do
  if ! wait -n; then
    echo "gpu_ssh.sh: a host's run failed (its [i] lines above); stopping the runs on every host" >&2
    stop_and_exit 1
  fi
done
