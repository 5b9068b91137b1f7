#!/usr/bin/env bash
# Shared helpers for the launch scripts (sourced, not run). Callers set `dry_run` (0 or 1).

# Single-quotes an argument unless it is made of safe characters only.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

# Prints the command (one line, shell-quoted, pastable) in dry-run mode; runs it otherwise.
run() {
  if [[ "${dry_run:-0}" == 1 ]]; then
    local out="" arg
    for arg in "$@"; do out+="${out:+ }$(quote "$arg")"; done
    echo "$out"
  else
    "$@"
  fi
}

# Prints one line per worker: "rljax-versions python=... jax=... jaxlib=... libtpu=... rljax=...",
# in one write, so lines from workers printing at once do not interleave (print writes twice).
# shellcheck disable=SC2034  # used by the scripts that source this file
versions_py='import sys, importlib.metadata as m; have = {d.metadata["Name"].lower().replace("_", "-") for d in m.distributions()}; sys.stdout.write(" ".join(["rljax-versions", "python=" + sys.version.split()[0], *[p + "=" + (m.version(p) if p in have else "none") for p in ("jax", "jaxlib", "libtpu", "rljax")]]) + "\n")'

# Reads the workers' output on stdin; fails unless every "rljax-versions" line is identical.
same_versions() {
  local distinct
  distinct="$(grep '^rljax-versions' | sort -u || true)"
  if [[ -z "$distinct" ]]; then
    echo "launch: no worker reported its versions; install jax and rljax on every worker first" >&2
    return 1
  fi
  if [[ "$(wc -l <<<"$distinct")" -ne 1 ]]; then
    # One line: each package whose version differs, with the versions seen (e.g. "jax 0.0.1 vs 0.10.2").
    local differ
    differ="$(tr ' ' '\n' <<<"$distinct" | grep '=' | sort -u | cut -d= -f1 | uniq -c \
      | awk '$1 > 1 {print $2}' | while read -r pkg; do
          printf '%s %s; ' "$pkg" "$(tr ' ' '\n' <<<"$distinct" | sed -n "s/^$pkg=//p" | sort -u | paste -sd' ' - | sed 's/ / vs /g')"
        done)"
    echo "launch: workers disagree on ${differ%; }: run setup again so every worker installs the same wheel and jax" >&2
    return 1
  fi
  echo "launch: all workers match: ${distinct#rljax-versions }"
}

# Prints "rljax-devices local=N platform=P host=H": the JAX devices this worker sees (on a TPU
# host, libtpu's chips; a jax without TPU support falls back to 1 CPU device), in one write.
# shellcheck disable=SC2034  # used by the scripts that source this file
devices_py='import jax, socket, sys; sys.stdout.write(" ".join(["rljax-devices", "local=%d" % jax.local_device_count(), "platform=" + jax.default_backend(), "host=" + socket.gethostname()]) + "\n")'

# Reads the workers' output on stdin; fails with one line unless HOSTS ($1) workers sent an
# "rljax-devices" line and each saw PER_HOST ($2) devices, as the accelerator type $3 implies.
same_devices() {
  local hosts="$1" per_host="$2" what="$3" lines count bad
  lines="$(grep '^rljax-devices' || true)"
  count="$(grep -c . <<<"$lines" || true)"
  if (( count != hosts )); then
    echo "launch: $count workers answered but $what has $hosts hosts; pass the slice's own type (--type), or none to ask gcloud" >&2
    return 1
  fi
  bad="$(grep -v " local=$per_host " <<<"$lines" | head -n 1 || true)"
  if [[ -n "$bad" ]]; then
    echo "launch: a worker sees the wrong number of JAX devices (${bad#rljax-devices }) for $what, which has $per_host per host; install jax[tpu] on every worker (setup) and stop any run that holds the TPU (stop)" >&2
    return 1
  fi
  echo "launch: $hosts workers x $per_host JAX devices, as $what implies"
}

# The version in a checkout's pyproject.toml (the wheel `pip wheel` builds is named after it).
version_of() {
  sed -n 's/^version = "\(.*\)"/\1/p' "$1/pyproject.toml" | head -n 1
}

# Sets `wheel` to a wheel of the checkout at $1, built with `pip wheel --no-deps` into
# $1/build/launch (the code the user has; PyPI's `rljax` is an unrelated project). $2 names the
# calling script in the error line.
checkout_wheel() {
  local root="$1" out="$1/build/launch"
  run python3 -m pip wheel --no-deps --quiet --wheel-dir "$out" "$root"
  wheel="$out/rljax-$(version_of "$root")-py3-none-any.whl"
  [[ "${dry_run:-0}" == 1 || -f "$wheel" ]] || { echo "$2: pip wheel wrote no $wheel; pass --wheel PATH" >&2; return 2; }
}

# Fails with one line when the pip spec $2 names PyPI's unrelated `rljax` ($1: the calling script).
refuse_pypi_rljax() {
  if [[ "$2" == "rljax" || "$2" == rljax[=\<\>~\[]* ]]; then
    echo "$1: --pip-spec $2 would install the unrelated PyPI project named rljax; pass --wheel PATH or a git URL" >&2
    return 2
  fi
}
