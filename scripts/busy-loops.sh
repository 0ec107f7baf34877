#!/usr/bin/env bash
# Run a command beside busy loops, so that it meets a loaded machine:
#
#     bash scripts/busy-loops.sh make test
#     BUSY_LOOPS=4 bash scripts/busy-loops.sh .venv/bin/python -m pytest tests/docker -q
#
# BUSY_LOOPS (default 2) CPU-bound shell loops run at normal priority for as long as the
# command does. They are killed when it ends, however it ends: success, failure, Ctrl-C or
# SIGTERM to this script (bash runs the trap once the command has returned). Each loop also
# ends on its own as soon as this script is gone, so not even a SIGKILL of it leaves one
# spinning. The exit status is the command's.
set -uo pipefail

if [ $# -eq 0 ]; then
    echo "usage: $0 COMMAND [ARG...]  (runs COMMAND beside \${BUSY_LOOPS:-2} busy loops)" >&2
    exit 2
fi
count=${BUSY_LOOPS:-2}
if ! [[ $count =~ ^[0-9]+$ ]]; then
    echo "BUSY_LOOPS=$count: expected a whole number of loops, e.g. BUSY_LOOPS=2" >&2
    exit 2
fi

loops=()
stop_loops() {
    if [ ${#loops[@]} -gt 0 ]; then
        kill "${loops[@]}" 2>/dev/null
        wait "${loops[@]}" 2>/dev/null
        loops=()
    fi
}
trap stop_loops EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for ((i = 0; i < count; i++)); do
    # `kill -0` (a shell builtin) checks that this script is still there; the loop is busy
    # either way, and it cannot outlive the script by more than one iteration.
    sh -c 'while kill -0 "$1" 2>/dev/null; do :; done' busy-loop "$$" &
    loops+=("$!")
done
echo "busy-loops: ${#loops[@]} loops running (pids ${loops[*]:-none}) beside: $*" >&2

"$@"
