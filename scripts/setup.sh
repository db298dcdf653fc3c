#!/usr/bin/env bash
# One idempotent set-up for a fresh Debian 12 machine: the Vulkan loader, Mesa 25 from
# bookworm-backports (lavapipe runs kernels on the CPU; RADV's null device compiles for
# RDNA targets), then zdsl in a virtual environment (.venv) with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

have_mesa25() {
    dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -qE '^(2[5-9]|[3-9][0-9])\.'
}

if ! have_mesa25 || ! dpkg-query -W libvulkan1 >/dev/null 2>&1; then
    # Use the mirror the machine already uses for bookworm.
    # Active lines only (one-line `deb` entries or deb822 `URIs:`, not comments); a missing
    # sources.list (deb822-only machines) is not an error.
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
             | awk '/^[[:space:]]*(deb|URIs:)/ { for (i = 1; i <= NF; i++) if (!found && $i ~ /^https?:\/\/.*\/debian\/?$/) found = $i }
                    END { print found }') || true
    mirror=${mirror:-http://deb.debian.org/debian}
    list=/etc/apt/sources.list.d/zdsl-bookworm-backports.list
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo "deb ${mirror%/} bookworm-backports main" | $SUDO tee "$list" >/dev/null
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        -t bookworm-backports mesa-vulkan-drivers libvulkan1 python3-venv >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.zdsl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    touch "$stamp"
fi
