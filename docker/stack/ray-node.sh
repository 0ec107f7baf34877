#!/bin/sh
# Join this container to the stack's Ray cluster as a node offering RESOURCES (a JSON object,
# e.g. '{"omniloop_rollout": 100}'), then run the rest of the arguments (default: stay up).
# SIGTERM (a stop) goes to that command first, which then ends as it would on its own (sandboxd
# removes its sandboxes), then the node leaves the cluster.
set -eu
resources=${1:?usage: ray-node.sh RESOURCES [COMMAND...]}
shift
ray start --address="${RAY_HEAD:-ray-head}:6379" --node-ip-address="$(hostname -i | cut -d' ' -f1)" \
  --resources="$resources" --object-store-memory=200000000 --disable-usage-stats >/dev/null
if [ "$#" -gt 0 ]; then
  "$@" &
else
  sleep infinity &
fi
child=$!
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; ray stop --force >/dev/null 2>&1; exit 0' TERM INT
wait "$child"
