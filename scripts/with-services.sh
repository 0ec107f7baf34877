#!/usr/bin/env bash
# Run a command with the services the tests need (dockerd), and stop them afterwards,
# whatever the command's outcome.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/dockerd.sh
dockerd_start || echo "dockerd did not start; Docker tests will fail" >&2
trap dockerd_stop EXIT
"$@"
