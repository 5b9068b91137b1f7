#!/usr/bin/env bash
# Run `rljax train` on a Cloud TPU VM or pod slice with gcloud.
#
#   launch/tpu.sh ACTION [options] [-- TRAIN_ARGS...]
#
# Actions:
#   create   create the TPU VM / pod slice
#   setup    copy the rljax wheel to every worker and install it there with jax[tpu]
#   check    fail unless every worker reports the same python/jax/jaxlib/libtpu versions
#   train    check, then start `python3 -m rljax train TRAIN_ARGS` detached on all workers and
#            stream logs
#   logs     stream worker 0's training log
#   stop     stop the training processes on all workers
#   delete   delete the slice
#   up       create, setup, check and train
#
# Options:
#   --name NAME            slice name (required)
#   --zone ZONE            e.g. us-central2-b (required)
#   --type TYPE            accelerator type, e.g. v4-32, v5litepod-16 (create; default v4-8)
#   --version VERSION      TPU software version (create; default tpu-ubuntu2204-base)
#   --project PROJECT      GCP project (default: gcloud's configured project)
#   --spot                 create a spot slice
#   --jax SPEC             pip spec for jax (default "jax[tpu]>=0.10.2,<0.11")
#   --wheel PATH           the rljax wheel to install (default: built from this checkout with
#                          `pip wheel --no-deps` into build/launch/); copied to every worker
#   --pip-spec SPEC        install rljax from a pip spec you control instead (a git URL, or an
#                          index name that is yours): never "rljax" from PyPI, which is another
#                          project
#   --log FILE             log path on each worker (default rljax-train.log)
#   --dry-run              print the exact commands instead of running them
#
# Every worker runs with RLJAX_DISTRIBUTED=auto, so `rljax train` joins the slice through
# jax.distributed.initialize() (TPU auto-detection). A jax/libtpu mismatch between workers is
# the most common multi-host failure; `check` runs before every `train`.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

action="${1:-}"
if [[ -z "$action" || "$action" == "-h" || "$action" == "--help" ]]; then usage; exit 0; fi
shift

name="" zone="" type="v4-8" version="tpu-ubuntu2204-base" project="" spot=0 dry_run=0
jax_spec="jax[tpu]>=0.10.2,<0.11" wheel="" pip_spec="" log="rljax-train.log"
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --spot) spot=1; shift ;;
    --jax) jax_spec="$2"; shift 2 ;;
    --wheel) wheel="$2"; shift 2 ;;
    --pip-spec) pip_spec="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "tpu.sh: unknown option '$1'; see launch/tpu.sh --help" >&2; exit 2 ;;
  esac
done
[[ -n "$name" ]] || { echo "tpu.sh: --name is required" >&2; exit 2; }
[[ -n "$zone" ]] || { echo "tpu.sh: --zone is required" >&2; exit 2; }
if [[ "$pip_spec" == "rljax" || "$pip_spec" == rljax[=\<\>~]* ]]; then
  echo "tpu.sh: --pip-spec $pip_spec would install the unrelated PyPI project named rljax; pass --wheel PATH or a git URL" >&2
  exit 2
fi

# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=("--zone=$zone")
[[ -n "$project" ]] && where+=("--project=$project")

# Runs a shell command on the given worker(s) ("all" or an index).
on_workers() {
  local workers="$1" command="$2"
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" "--worker=$workers" "--command=$command"
}

create() {
  local args=("${gcloud_tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$type" "--version=$version")
  [[ "$spot" == 1 ]] && args+=(--spot)
  run "${args[@]}"
}

# The wheel to install: --wheel, else one built from this checkout (the code the user has).
build_wheel() {
  if [[ -z "$wheel" ]]; then
    local root out
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    out="$root/build/launch"
    run python3 -m pip wheel --no-deps --quiet --wheel-dir "$out" "$root"
    wheel="$out/rljax-$(version_of "$root")-py3-none-any.whl"
  fi
  [[ "$dry_run" == 1 || -f "$wheel" ]] || { echo "tpu.sh: no wheel at $wheel; pass --wheel PATH" >&2; exit 2; }
}

setup() {
  if [[ -n "$pip_spec" ]]; then
    on_workers all "python3 -m pip install --upgrade $(quote "$jax_spec") $(quote "$pip_spec")"
    return
  fi
  build_wheel
  run "${gcloud_tpu[@]}" scp "$wheel" "$name:" "${where[@]}" --worker=all
  on_workers all "python3 -m pip install --upgrade $(quote "$jax_spec") ./$(quote "$(basename "$wheel")")"
}

check() {
  local command="python3 -c '$versions_py'"
  if [[ "$dry_run" == 1 ]]; then on_workers all "$command"; return; fi
  on_workers all "$command" | same_versions
}

train() {
  check
  local quoted=""
  local arg
  for arg in "${train_args[@]}"; do quoted+=" $(quote "$arg")"; done
  on_workers all "RLJAX_DISTRIBUTED=auto nohup python3 -m rljax train$quoted > $log 2>&1 < /dev/null & echo \$! > $log.pid"
  logs
}

logs() { on_workers 0 "tail -n +1 -F $log"; }

stop() { on_workers all "if [ -f $log.pid ]; then kill \$(cat $log.pid) && rm -f $log.pid; fi"; }

delete() { run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet; }

case "$action" in
  create) create ;;
  setup) setup ;;
  check) check ;;
  train) train ;;
  logs) logs ;;
  stop) stop ;;
  delete) delete ;;
  up) create; setup; train ;;
  *) echo "tpu.sh: unknown action '$action'; choose create, setup, check, train, logs, stop, delete or up" >&2; exit 2 ;;
esac
