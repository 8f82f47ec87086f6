#!/usr/bin/env bash
# Install Debian's chromium and chromium-driver for the browser tests (tests/browser)
# when they are missing and this machine can: apt-get, as root or with sudo. Else say
# what is missing and go on: the browser tests then fail, naming what to install
# (or leave them out with -m "not browser").
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
say() { echo "tools/browser.sh: $*" >&2; }
if ! command -v apt-get >/dev/null 2>&1; then
  say "no chromium/chromedriver and no apt-get: install Chromium and its ChromeDriver for tests/browser"
  exit 0
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo)
  else
    say "no chromium/chromedriver, and not root: run 'apt-get install chromium chromium-driver'"
    exit 0
  fi
fi
say "installing chromium and chromium-driver (Debian packages) for tests/browser"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq >/dev/null || say "apt-get update failed; trying the install anyway"
"${SUDO[@]}" apt-get install -y -qq chromium chromium-driver >/dev/null
