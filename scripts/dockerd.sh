#!/usr/bin/env bash
# Start and stop a private dockerd for tests: its own data/exec roots and socket, no bridge,
# no iptables (sandboxes use --network none). Sourced by with-services.sh.
OMNILOOP_DOCKER_DIR=${OMNILOOP_DOCKER_DIR:-/var/lib/omniloop-docker}
OMNILOOP_DOCKER_SOCK=${OMNILOOP_DOCKER_SOCK:-/run/omniloop-docker.sock}

dockerd_start() {
  export DOCKER_HOST="unix://$OMNILOOP_DOCKER_SOCK"
  if docker info >/dev/null 2>&1; then return 0; fi
  command -v dockerd >/dev/null || return 1
  mkdir -p "$OMNILOOP_DOCKER_DIR/data" "$OMNILOOP_DOCKER_DIR/exec"
  dockerd --data-root "$OMNILOOP_DOCKER_DIR/data" --exec-root "$OMNILOOP_DOCKER_DIR/exec" \
    -H "$DOCKER_HOST" --pidfile "$OMNILOOP_DOCKER_DIR/dockerd.pid" \
    --iptables=false --bridge=none >"$OMNILOOP_DOCKER_DIR/dockerd.log" 2>&1 &
  for _ in $(seq 100); do
    docker info >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  tail -n 20 "$OMNILOOP_DOCKER_DIR/dockerd.log" >&2
  return 1
}

dockerd_stop() {
  local pidfile="$OMNILOOP_DOCKER_DIR/dockerd.pid"
  [[ -f $pidfile ]] || return 0
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null
  # containerd shims started under our exec root outlive a killed dockerd.
  pkill -9 -f "containerd-shim.*$OMNILOOP_DOCKER_DIR" 2>/dev/null
  rm -f "$pidfile"
  return 0
}
