#!/bin/sh
# Start PostgreSQL on $PGDATA, making the cluster, its role and its database on first start
# (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB; the password from POSTGRES_PASSWORD_FILE
# when that is set). Runs as the `postgres` user; the server replaces this shell.
set -eu
bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/postgres | sort -V | tail -n 1)")
user=${POSTGRES_USER:-omniloop}
db=${POSTGRES_DB:-$user}
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
  password=$(cat "$POSTGRES_PASSWORD_FILE")
else
  password=${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE}
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$password" >"$pwfile"
  "$bin/initdb" -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-host=scram-sha-256 \
    --auth-local=trust -E UTF8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  [ "$db" = postgres ] || "$bin/createdb" -h /run/postgresql -U "$user" "$db"
  "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/run/postgresql
