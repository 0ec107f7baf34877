#!/usr/bin/env bash
# Start and stop a private dockerd for tests: its own data/exec roots and socket, no bridge,
# no iptables (sandboxes use --network none). Sourced by with-services.sh.
#
# When runsc (gVisor) is installed it is registered as the runtime `runsc`, through a wrapper
# that adds --network=none (registering runsc bare fails here: it tries to set up a network
# stack Docker's --bridge=none cannot give it; sandboxes run with network none anyway) and
# --oci-seccomp (so Docker's default seccomp profile also applies inside gVisor).
OMNILOOP_DOCKER_DIR=${OMNILOOP_DOCKER_DIR:-/var/lib/omniloop-docker}
OMNILOOP_DOCKER_SOCK=${OMNILOOP_DOCKER_SOCK:-/run/omniloop-docker.sock}

dockerd_start() {
  export DOCKER_HOST="unix://$OMNILOOP_DOCKER_SOCK"
  if docker info >/dev/null 2>&1; then return 0; fi
  command -v dockerd >/dev/null || return 1
  mkdir -p "$OMNILOOP_DOCKER_DIR/data" "$OMNILOOP_DOCKER_DIR/exec"
  local runtime_args=()
  if command -v runsc >/dev/null; then
    local wrapper="$OMNILOOP_DOCKER_DIR/runsc-none"
    printf '#!/bin/sh\nexec %s --network=none --oci-seccomp "$@"\n' "$(command -v runsc)" >"$wrapper"
    chmod 755 "$wrapper"
    runtime_args=(--add-runtime "runsc=$wrapper")
  fi
  dockerd --data-root "$OMNILOOP_DOCKER_DIR/data" --exec-root "$OMNILOOP_DOCKER_DIR/exec" \
    -H "$DOCKER_HOST" --pidfile "$OMNILOOP_DOCKER_DIR/dockerd.pid" \
    --iptables=false --bridge=none "${runtime_args[@]}" >"$OMNILOOP_DOCKER_DIR/dockerd.log" 2>&1 &
  for _ in $(seq 100); do
    docker info >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  tail -n 20 "$OMNILOOP_DOCKER_DIR/dockerd.log" >&2
  return 1
}

# Pids of processes whose command line names our docker dir: the containerd shims and runsc
# sandboxes/gofers this dockerd started. They are reparented to init when dockerd dies, so
# they are found by what they were started with, never by a bare program name.
_dockerd_leftover_pids() {
  local d pid cmd
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [[ $pid == "$$" ]] && continue
    cmd=$(tr '\0' ' ' 2>/dev/null <"$d/cmdline") || continue
    [[ $cmd == *"$OMNILOOP_DOCKER_DIR/exec"* ]] && echo "$pid"
  done
}

dockerd_stop() {
  local pidfile="$OMNILOOP_DOCKER_DIR/dockerd.pid"
  [[ -f $pidfile ]] || return 0
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null
  # containerd shims (and runsc sandboxes) started under our exec root outlive a killed dockerd.
  local leftover
  for leftover in $(_dockerd_leftover_pids); do
    kill -9 "$leftover" 2>/dev/null
  done
  rm -f "$pidfile"
  return 0
}
