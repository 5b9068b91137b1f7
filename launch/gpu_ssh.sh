#!/usr/bin/env bash
# Run `rljax train` on several GPU hosts over plain SSH: one process per host, owning its GPUs.
#
#   launch/gpu_ssh.sh --hosts HOST0,HOST1[,...] [options] [-- TRAIN_ARGS...]
#
# Options:
#   --hosts LIST     comma-separated SSH hosts; the first one runs the coordinator (required)
#   --port PORT      coordinator port on the first host (default 12355)
#   --workdir DIR    directory on every host to run in (default: the remote home)
#   --activate FILE  script to source first on every host, e.g. .venv/bin/activate
#   --check-only     only check that every host has the same python/jax/jaxlib versions
#   --dry-run        print the exact commands instead of running them
#
# Process i gets RLJAX_COORDINATOR_ADDRESS=HOST0:PORT, RLJAX_NUM_PROCESSES=N and
# RLJAX_PROCESS_ID=i, which `rljax train` passes to jax.distributed.initialize. Versions are
# checked first; if any host's process fails, the others are stopped.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

hosts="" port=12355 workdir="" activate="" check_only=0 dry_run=0
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hosts) hosts="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --activate) activate="$2"; shift 2 ;;
    --check-only) check_only=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "gpu_ssh.sh: unknown option '$1'; see launch/gpu_ssh.sh --help" >&2; exit 2 ;;
  esac
done
[[ -n "$hosts" ]] || { echo "gpu_ssh.sh: --hosts is required (e.g. --hosts gpu0,gpu1)" >&2; exit 2; }

# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

IFS=, read -r -a host_list <<<"$hosts"
coordinator="${host_list[0]#*@}"  # the first host, without a user@ prefix

prefix=""
[[ -n "$workdir" ]] && prefix+="cd $(quote "$workdir") && "
[[ -n "$activate" ]] && prefix+="source $(quote "$activate") && "

check() {
  local host
  for host in "${host_list[@]}"; do
    run ssh -o BatchMode=yes "$host" "${prefix}python3 -c '$versions_py'"
  done
}

if [[ "$dry_run" == 1 ]]; then check; else check | same_versions; fi
[[ "$check_only" == 1 ]] && exit 0

quoted=""
for arg in "${train_args[@]}"; do quoted+=" $(quote "$arg")"; done

pids=()
stop_all() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_all INT TERM

for i in "${!host_list[@]}"; do
  env_vars="RLJAX_COORDINATOR_ADDRESS=$coordinator:$port RLJAX_NUM_PROCESSES=${#host_list[@]} RLJAX_PROCESS_ID=$i"
  # -tt ties the remote process to this connection, so killing ssh stops it.
  if [[ "$dry_run" == 1 ]]; then
    run ssh -tt -o BatchMode=yes "${host_list[$i]}" "${prefix}env $env_vars python3 -m rljax train$quoted"
  else
    ssh -tt -o BatchMode=yes "${host_list[$i]}" "${prefix}env $env_vars python3 -m rljax train$quoted" \
      2>&1 | sed -u "s/^/[$i] /" &
    pids+=("$!")
  fi
done

status=0
for pid in "${pids[@]}"; do
  if ! wait "$pid"; then status=1; stop_all; fi
done
exit "$status"
