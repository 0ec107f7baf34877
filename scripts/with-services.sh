#!/usr/bin/env bash
# Run a command with the services the tests need (dockerd, PostgreSQL), and stop them
# afterwards, whatever the command's outcome.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/dockerd.sh
source scripts/postgres.sh
trap 'postgres_stop; dockerd_stop' EXIT
dockerd_start || echo "dockerd did not start; Docker tests will fail" >&2
postgres_start || echo "PostgreSQL did not start; store tests will fail" >&2
"$@"
