#!/usr/bin/env bash
# Run `rljax train` on a Cloud TPU VM or pod slice with gcloud.
#
#   launch/tpu.sh ACTION [options] [-- TRAIN_ARGS...]
#
# Actions:
#   create   create the slice (--queued: through a queued resource, waiting until it is ACTIVE)
#   setup    copy the rljax wheel to every worker and install it there, with its [gcs] extra
#            (gcsfs, for gs:// paths) and jax[tpu]
#   check    fail unless every worker reports the same python/jax/jaxlib/libtpu/rljax versions
#            and the number of JAX devices per host that the accelerator type implies
#   train    check, then start `python3 -m rljax train TRAIN_ARGS` detached on all workers and
#            stream worker 0's log until the run ends; exits with the run's exit status
#   logs     stream worker 0's training log until the run ends
#   stop     stop the training processes (the whole process group) on all workers: SIGTERM,
#            then SIGKILL (JAX treats SIGTERM as a preemption notice and keeps running)
#   delete   delete the slice (--queued: the queued resource, with its slice)
#   up       create, setup and train
#
# Options:
#   --name NAME            slice name (required)
#   --zone ZONE            e.g. us-central2-b (required)
#   --type TYPE            accelerator type: v4-N or v5p-N (N TensorCores, 2 per chip),
#                          v5litepod-N or v6e-N (N chips). create's default: v4-8; the other
#                          actions read it from the slice (gcloud describe) unless given
#   --version VERSION      TPU software version (default from --type: v4 tpu-ubuntu2204-base,
#                          v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e)
#   --project PROJECT      GCP project (default: gcloud's configured project)
#   --spot                 create a spot slice (preemptible; resume it with --resume)
#   --queued               create and delete through `gcloud compute tpus queued-resources`
#                          (the request waits in a queue until capacity is free)
#   --queue-timeout S      how long create --queued waits for ACTIVE (default 3600; 0: no limit)
#   --bucket URI           the run's output_dir, e.g. gs://BUCKET/runs/NAME: checkpoints and metrics
#                          go where every worker can reach them (an output_dir= in TRAIN_ARGS wins)
#   --resume               continue the run in output_dir from its latest checkpoint (rljax train
#                          --resume)
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
# RLJAX_TPU_POLL_S (default 30) sets how often create --queued asks for the queued state;
# RLJAX_TPU_STOP_GRACE_S (default 10) how long stop waits after SIGTERM before SIGKILL.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

action="${1:-}"
if [[ -z "$action" || "$action" == "-h" || "$action" == "--help" ]]; then usage; exit 0; fi
shift

name="" zone="" type="" version="" project="" spot=0 queued=0 queue_timeout=3600 bucket="" resume=0
dry_run=0 jax_spec="jax[tpu]>=0.10.2,<0.11" wheel="" pip_spec="" log="rljax-train.log"
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --spot) spot=1; shift ;;
    --queued) queued=1; shift ;;
    --queue-timeout) queue_timeout="$2"; shift 2 ;;
    --bucket) bucket="$2"; shift 2 ;;
    --resume) resume=1; shift ;;
    --jax) jax_spec="$2"; shift 2 ;;
    --wheel) wheel="$2"; shift 2 ;;
    --pip-spec) pip_spec="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "tpu.sh: unknown option '$1'; see launch/tpu.sh --help" >&2; exit 2 ;;
  esac
done

# One line naming the problem and the fix, then exit 2 (bad input, caught before any gcloud call).
die() { echo "tpu.sh: $*" >&2; exit 2; }

[[ -n "$name" ]] || die "--name is required"
[[ -n "$zone" ]] || die "--zone is required"
# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
refuse_pypi_rljax tpu.sh "$pip_spec" || exit 2
[[ "$zone" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z0-9]+$ ]] \
  || die "--zone $zone is not a zone name; pass REGION-ZONE, e.g. us-central2-b (gcloud compute zones list)"
[[ "$queue_timeout" =~ ^[0-9]+$ ]] || die "--queue-timeout $queue_timeout must be a number of seconds"
# A pod's workers share no disk: a local output_dir would split each checkpoint over their disks.
[[ -z "$bucket" || "$bucket" =~ ^[a-z][a-z0-9+.-]*://.+ ]] \
  || die "--bucket $bucket is a local path, but each worker has its own disk; pass gs://BUCKET/PATH"
if [[ -z "$type" && ( "$action" == create || "$action" == up ) ]]; then type="v4-8"; fi

# Sets generation, chips_per_host and hosts from $type (Google's tables: v4-N and v5p-N count
# TensorCores, 2 per chip; v5litepod-N and v6e-N count chips; a multi-host slice has 4 chips per
# host; one host holds up to 4 chips on v4/v5p and 8 on v5e/v6e), or fails with one line.
parse_type() {
  if [[ ! "$type" =~ ^(v4|v5p|v5litepod|v6e)-([0-9]+)$ ]]; then
    [[ "$type" =~ ^[a-z0-9]+-[0-9]+$ ]] || die "--type $type is not an accelerator type; pass GENERATION-SIZE, e.g. v4-16, v5litepod-8"
    die "--type $type: generation ${type%-*} is not one this script knows; use v4-N, v5p-N, v5litepod-N or v6e-N"
  fi
  generation="${BASH_REMATCH[1]}"
  local size="${BASH_REMATCH[2]}" chips single_host_max
  case "$generation" in
    v4|v5p)
      (( size >= 8 && size % 8 == 0 )) \
        || die "--type $type: $generation sizes count TensorCores (2 per chip, 4 chips per host): $generation-8, $generation-16, $generation-32, ..."
      chips=$((size / 2)) single_host_max=4 ;;
    *)
      [[ " 1 4 8 16 32 64 128 256 " == *" $size "* ]] \
        || die "--type $type: $generation sizes count chips: 1, 4, 8, 16, 32, 64, 128 or 256"
      chips=$size single_host_max=8 ;;
  esac
  if (( chips <= single_host_max )); then chips_per_host=$chips hosts=1; else chips_per_host=4 hosts=$((chips / 4)); fi
}

# The runtime Google lists for JAX on each generation (cloud.google.com/tpu/docs/runtimes).
default_version() {
  case "$generation" in
    v4) echo tpu-ubuntu2204-base ;;
    v5litepod) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v6e) echo v2-alpha-tpuv6e ;;
  esac
}

if [[ -n "$type" ]]; then
  parse_type
  [[ -n "$version" ]] || version="$(default_version)"
fi


gcloud_tpu=(gcloud compute tpus tpu-vm)
gcloud_queued=(gcloud compute tpus queued-resources)
where=("--zone=$zone")
[[ -n "$project" ]] && where+=("--project=$project")

# Runs a shell command on the given worker(s) ("all" or an index).
on_workers() {
  local workers="$1" command="$2"
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" "--worker=$workers" "--command=$command"
}

# The slice's accelerator type when --type was not given: what gcloud says the slice is.
slice_type() {
  [[ -n "$type" ]] && return
  local describe=("${gcloud_tpu[@]}" describe "$name" "${where[@]}" "--format=value(acceleratorType)")
  if [[ "$dry_run" == 1 ]]; then run "${describe[@]}"; return; fi
  type="$("${describe[@]}")" \
    || { echo "tpu.sh: gcloud found no slice $name in $zone; create it (tpu.sh create) or fix --name/--zone/--project" >&2; exit 1; }
  parse_type
}

# Fails with one line unless $zone offers $type: a known mismatch warns even in --dry-run;
# a real run asks gcloud before creating anything.
check_offered() {
  if [[ "$generation" == v4 && "$zone" != us-central2-b ]]; then
    echo "tpu.sh: warning: Google lists v4 in us-central2-b only, not $zone; check gcloud compute tpus accelerator-types list --zone=$zone" >&2
  fi
  [[ "$dry_run" == 1 ]] && return
  gcloud compute tpus accelerator-types describe "$type" "${where[@]}" > /dev/null 2>&1 \
    || { echo "tpu.sh: $zone offers no $type (or this project cannot use the TPU API there); see gcloud compute tpus accelerator-types list --zone=$zone" >&2; exit 1; }
}

create() {
  check_offered
  if [[ "$queued" == 1 ]]; then create_queued; return; fi
  local args=("${gcloud_tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$type" "--version=$version")
  [[ "$spot" == 1 ]] && args+=(--spot)
  run "${args[@]}"
}

# A queued resource named like its slice (--node-id), then polls until it is ACTIVE.
create_queued() {
  local args=("${gcloud_queued[@]}" create "$name" "--node-id=$name" "${where[@]}" "--accelerator-type=$type"
              "--runtime-version=$version")
  [[ "$spot" == 1 ]] && args+=(--spot)
  run "${args[@]}"
  local describe=("${gcloud_queued[@]}" describe "$name" "${where[@]}" "--format=value(state.state)")
  if [[ "$dry_run" == 1 ]]; then run "${describe[@]}"; return; fi
  local state start=$SECONDS
  while true; do
    state="$("${describe[@]}")"
    case "$state" in
      ACTIVE) echo "tpu.sh: queued resource $name is ACTIVE"; return ;;
      FAILED|SUSPENDING|SUSPENDED)
        echo "tpu.sh: queued resource $name is $state; free it with tpu.sh delete --queued, then retry (another zone or --spot may have capacity)" >&2
        exit 1 ;;
    esac
    if (( queue_timeout > 0 && SECONDS - start >= queue_timeout )); then
      echo "tpu.sh: queued resource $name is still $state after ${queue_timeout}s; wait longer with --queue-timeout, or free it with tpu.sh delete --queued" >&2
      exit 1
    fi
    echo "tpu.sh: queued resource $name is $state; asking again in ${RLJAX_TPU_POLL_S:-30}s"
    sleep "${RLJAX_TPU_POLL_S:-30}"
  done
}

# The wheel to install: --wheel, else one built from this checkout (the code the user has).
build_wheel() {
  if [[ -z "$wheel" ]]; then
    checkout_wheel "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" tpu.sh || exit 2
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
  on_workers all "python3 -m pip install --upgrade $(quote "$jax_spec") $(quote "./$(basename "$wheel")[gcs]")"
}

check() {
  slice_type
  local command="python3 -c '$versions_py'; python3 -c '$devices_py'"
  if [[ "$dry_run" == 1 ]]; then on_workers all "$command"; return; fi
  local out
  out="$(on_workers all "$command")" \
    || { echo "tpu.sh: the check failed on a worker (its error is above); run tpu.sh setup first" >&2; exit 1; }
  same_versions <<<"$out"
  same_devices "$hosts" "$chips_per_host" "$type" <<<"$out"
}

train() {
  check
  local args=("${train_args[@]}") arg has_output_dir=0
  for arg in "${args[@]}"; do [[ "$arg" == output_dir=* ]] && has_output_dir=1; done
  [[ -n "$bucket" && "$has_output_dir" == 0 ]] && args+=("output_dir=$bucket")
  [[ "$resume" == 1 ]] && args+=(--resume)
  local quoted=""
  for arg in "${args[@]}"; do quoted+=" $(quote "$arg")"; done
  # setsid: the run is its own process group, which `stop` ends whole; its exit status lands in
  # $log.exit for `logs` to return.
  local run_command="python3 -m rljax train$quoted; echo \$? > $log.exit"
  on_workers all "rm -f $log.exit; RLJAX_DISTRIBUTED=auto setsid nohup bash -c $(quote "$run_command") > $log 2>&1 < /dev/null & echo \$! > $log.pid"
  logs
}

logs() {
  on_workers 0 "if [ -f $log.pid ]; then tail -n +1 -F --pid=\"\$(cat $log.pid)\" $log; else tail -n +1 $log; fi; if [ -f $log.exit ]; then exit \"\$(cat $log.exit)\"; fi; echo 'tpu.sh: the run has no exit status: it was stopped or killed' >&2; exit 1"
}

# TERM, then KILL after a grace period: once jax.distributed is up, JAX takes SIGTERM as a
# preemption notice and the process keeps running.
stop() {
  local grace="${RLJAX_TPU_STOP_GRACE_S:-10}"
  on_workers all "if [ -f $log.pid ]; then p=\"\$(cat $log.pid)\"; kill -TERM -- -\"\$p\" 2>/dev/null; for i in \$(seq $grace); do kill -0 -- -\"\$p\" 2>/dev/null || break; sleep 1; done; kill -KILL -- -\"\$p\" 2>/dev/null; rm -f $log.pid; fi"
}

delete() {
  if [[ "$queued" == 1 ]]; then
    run "${gcloud_queued[@]}" delete "$name" "${where[@]}" --force --quiet
  else
    run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
  fi
}

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
