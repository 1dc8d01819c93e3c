#!/usr/bin/env bash
# Installs every package pagedattn needs to build, test and run, from Debian/Ubuntu's archive.
# The single source of packages for README's commands, CI (.ci/run) and docker/Dockerfile.
#   scripts/install-deps.sh            build + test dependencies
#   scripts/install-deps.sh --runtime PKG...  install the named runtime library packages only
#   scripts/install-deps.sh --list-runtime    print the runtime library packages this machine's
#                                             build packages depend on (docker/Dockerfile)
set -euo pipefail

BUILD_PKGS=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
  openssl ca-certificates python3 python3-venv
)
# Runtime libraries: names differ between Debian 12 and Ubuntu 24.04, so they are resolved
# from what the build packages pulled in (see runtime_pkgs below).
RUNTIME_PATTERNS='^(libgrpc\+\+1|libgrpc[0-9]|libprotobuf[0-9]|libabsl[0-9]|libspdlog1|libfmt[0-9]|libssl3|libre2-[0-9]|libc-ares2)'

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

apt_install() {
  # Only hit the network when something is missing: a second run is instant.
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing ${missing[*]}"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "install-deps: all ${#@} packages already present"
  fi
}

if [ "${1:-}" = "--runtime" ]; then
  # Runtime-only images install the same library packages the build used, by name.
  shift
  apt_install "$@"
  exit 0
fi

if [ "${1:-}" = "--list-runtime" ]; then
  # Prints the runtime library packages this machine's build packages depend on
  # (used by docker/Dockerfile to keep its runtime stage in sync with this script).
  dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' | awk '$1 == "ii" {print $2}' |
    grep -E "$RUNTIME_PATTERNS" | sort -u
  exit 0
fi

apt_install "${BUILD_PKGS[@]}"
