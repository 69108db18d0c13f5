#!/usr/bin/env bash
# Installs the Debian packages pcpkv's build needs, by name, skipping those already installed.
# Uses sudo only when not running as root. CUDA (nvcc) is optional and not installed here: without it
# pcpkv builds the CPU backend only.
set -euo pipefail

packages=(cmake ninja-build g++ libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "setup: installing ${missing[*]}" >&2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: apt-get not found; install these packages (or their equivalents) by hand: ${missing[*]}" >&2
  exit 1
fi
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "setup: not root and sudo is missing; as root run: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  sudo_cmd=(sudo)
fi
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
