#!/usr/bin/env bash
# Installs Debian's headless-capable `chromium` when it is missing, for the test that renders
# toma's SVG pictures (tests/lazy/pictures.rs). Needs root (or password-less sudo) and apt; where
# neither is available it says so and the render check reports itself skipped.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-chromium: no apt-get here; the picture render test will be skipped" >&2
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "ensure-chromium: not root and no password-less sudo; the picture render test will be skipped" >&2
    exit 0
  fi
fi
echo "ensure-chromium: installing Debian's chromium (about 30 s)" >&2
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
  echo "ensure-chromium: apt-get could not install chromium; the picture render test will be skipped" >&2
fi
exit 0
