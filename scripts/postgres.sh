#!/usr/bin/env bash
# Start and stop a private PostgreSQL server for tests: its own data directory and socket
# directory, listening on loopback only, trust authentication (nothing beyond this host can
# connect). Sourced by with-services.sh, and by tests/integration/store/conftest.py when
# OMNILOOP_TEST_PG_URL is unset.
#
#   source scripts/postgres.sh
#   postgres_start   # exports OMNILOOP_TEST_PG_URL=postgresql+psycopg://postgres@127.0.0.1:PORT/DB
#   postgres_stop
#
# Needs the PostgreSQL server binaries (Debian: the `postgresql` package; the Debian cluster
# it creates is left alone). As root, the server runs as the `postgres` user, because
# PostgreSQL refuses to run as root; as any other user, it runs as that user.
#
# The server is a throwaway for tests: fsync and full-page writes are off, so a machine crash
# may corrupt it. Never point it at data you want to keep.
OMNILOOP_PG_DIR=${OMNILOOP_PG_DIR:-/var/lib/omniloop-postgres}
OMNILOOP_PG_DB=${OMNILOOP_PG_DB:-omniloop_test}
# OMNILOOP_PG_PORT: the TCP port; unset means the first free one from 55432 up.
# OMNILOOP_PG_BIN: the folder holding initdb and pg_ctl; unset means the newest installed.

_pg_bindir() {
  if [[ -n ${OMNILOOP_PG_BIN:-} ]]; then
    echo "$OMNILOOP_PG_BIN"
    return 0
  fi
  local dir
  for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [[ -x $dir/pg_ctl && -x $dir/initdb ]] && { echo "$dir"; return 0; }
  done
  # Other distributions put the server binaries on PATH.
  command -v pg_ctl >/dev/null && command -v initdb >/dev/null && {
    dirname "$(command -v pg_ctl)"
    return 0
  }
  return 1
}

# Run a command as the owner of the server's files.
_pg_as_owner() {
  if [[ $(id -u) -eq 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

_pg_port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

_pg_free_port() {
  local port
  for port in $(seq 55432 55531); do
    _pg_port_in_use "$port" || { echo "$port"; return 0; }
  done
  return 1
}

postgres_start() {
  local bin
  bin=$(_pg_bindir) || {
    echo "postgres.sh: no PostgreSQL server binaries (initdb, pg_ctl) found:" \
      "install the Debian package postgresql, or set OMNILOOP_PG_BIN" >&2
    return 1
  }
  local data="$OMNILOOP_PG_DIR/data" sock="$OMNILOOP_PG_DIR/sock"
  local log="$OMNILOOP_PG_DIR/postgres.log" port

  if [[ -f $data/postmaster.pid ]] && _pg_as_owner "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    # Already running (started by an earlier call): reuse it. Line 4 of postmaster.pid is the port.
    port=$(sed -n 4p "$data/postmaster.pid")
  else
    mkdir -p "$OMNILOOP_PG_DIR" "$sock" || return 1
    if [[ $(id -u) -eq 0 ]]; then
      id postgres >/dev/null 2>&1 || {
        echo "postgres.sh: running as root needs a 'postgres' user (the postgresql package creates it)" >&2
        return 1
      }
      chown postgres: "$OMNILOOP_PG_DIR" "$sock"
      runuser -u postgres -- test -w "$OMNILOOP_PG_DIR" || {
        echo "postgres.sh: user postgres cannot reach $OMNILOOP_PG_DIR: a parent folder is" \
          "not searchable by it (mode 700?); choose another OMNILOOP_PG_DIR" >&2
        return 1
      }
    fi
    chmod 700 "$OMNILOOP_PG_DIR"
    if [[ ! -s $data/PG_VERSION ]]; then
      _pg_as_owner "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C \
        --no-sync >"$OMNILOOP_PG_DIR/initdb.log" 2>&1 || {
        tail -n 20 "$OMNILOOP_PG_DIR/initdb.log" >&2
        return 1
      }
    fi
    port=${OMNILOOP_PG_PORT:-$(_pg_free_port)} || {
      echo "postgres.sh: no free port in 55432-55531; set OMNILOOP_PG_PORT" >&2
      return 1
    }
    # listen_addresses: loopback only. unix_socket_directories: our own folder, so nothing
    # clashes with a system cluster's /var/run/postgresql.
    local opts="-c listen_addresses=127.0.0.1 -p $port -k $sock"
    opts+=" -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    _pg_as_owner "$bin/pg_ctl" -D "$data" -l "$log" -w -t 60 -o "$opts" start >/dev/null || {
      tail -n 20 "$log" >&2
      return 1
    }
  fi

  local exists
  exists=$(_pg_as_owner "$bin/psql" -h "$sock" -p "$port" -U postgres -d postgres -Atq \
    -c "SELECT 1 FROM pg_database WHERE datname = '$OMNILOOP_PG_DB'") || return 1
  if [[ $exists != 1 ]]; then
    _pg_as_owner "$bin/createdb" -h "$sock" -p "$port" -U postgres "$OMNILOOP_PG_DB" || return 1
  fi
  export OMNILOOP_TEST_PG_URL="postgresql+psycopg://postgres@127.0.0.1:$port/$OMNILOOP_PG_DB"
  return 0
}

postgres_stop() {
  local data="$OMNILOOP_PG_DIR/data"
  [[ -f $data/postmaster.pid ]] || return 0
  local bin pid cmd
  pid=$(sed -n 1p "$data/postmaster.pid")
  bin=$(_pg_bindir) && _pg_as_owner "$bin/pg_ctl" -D "$data" -m fast -w -t 30 stop >/dev/null 2>&1 && return 0
  # pg_ctl failed (binaries gone, server hung): stop the postmaster it recorded, by pid.
  # The pid is checked to still be our postmaster (its command line names our data folder).
  [[ $pid =~ ^[0-9]+$ ]] && cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 0
  if [[ $cmd == *"$data"* ]]; then
    kill -INT "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null
  fi
  return 0
}
