#!/usr/bin/env bash
# Install every Debian package prefixd needs to build, test and run.
# Idempotent: does nothing when all packages are already installed.
# Runs as root, or through sudo when available.
set -euo pipefail

packages=(
  build-essential pkg-config meson ninja-build clang libclang-rt-14-dev
  libmicrohttpd-dev libjansson-dev liblmdb-dev lmdb-utils libxxhash-dev libcriterion-dev
  libopenblas-dev liblapacke-dev libssl-dev libinih-dev libsystemd-dev
  libpcre2-dev libutf8proc-dev libcurl4-openssl-dev curl python3 systemd haproxy
  libhiredis-dev redis-server openssl
  chromium python3-websocket
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node and npm run the official openai client test; any install that puts
# npm on PATH will do (Debian's packages, or NodeSource's nodejs, which
# bundles npm and conflicts with Debian's npm package).
if ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "install-deps: missing packages (${missing[*]}) and neither root nor sudo is available" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"

# The CUDA toolkit is optional: the build compiles the CUDA backend when nvcc
# is found (PATH or /usr/local/cuda/bin) and works without it.
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: nvcc not found; the CUDA backend will be skipped (install the CUDA Toolkit to enable it)"
fi
