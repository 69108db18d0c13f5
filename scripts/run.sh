#!/usr/bin/env bash
# Builds pcpkv if needed (installing the Debian packages it needs), then runs the main job:
#   ./scripts/run.sh [pcpkv run flags...]     e.g. ./scripts/run.sh --pcp 4 --tokens 8192 --json
# Environment: PCPKV_BUILD_DIR (default build), PCPKV_JOBS (build jobs, default: ninja's choice).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PCPKV_BUILD_DIR:-$root/build}"

# Everything but pcpkv's own report goes to stderr, so `./scripts/run.sh --json | jq` sees only JSON (apt-get
# prints its progress on stdout).
"$root/scripts/setup.sh" >&2
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >&2
fi
ninja -C "$build" ${PCPKV_JOBS:+-j "$PCPKV_JOBS"} pcpkv_cli >&2
exec "$build/pcpkv" run "$@"
