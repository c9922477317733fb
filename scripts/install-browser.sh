#!/usr/bin/env bash
# Headless Chromium for the report's browser test (tests/test_report.py), from Debian's packages.
# Best effort and idempotent: with Chromium already there (the common case: one `command -v`), without
# root or apt-get, or with LMFORGE_NO_BROWSER_INSTALL=1, nothing is installed (the browser test then
# skips with the reason). Only what Chromium needs (--no-install-recommends): headless with
# --no-sandbox --disable-gpu it uses neither the setuid sandbox, Mesa nor a notification daemon.
set -u
for b in "${LMFORGE_CHROMIUM:-}" chromium chromium-browser google-chrome; do
  if [ -n "$b" ] && command -v "$b" >/dev/null 2>&1; then echo "setup: Chromium is $(command -v "$b")"; exit 0; fi
done
if [ -n "${LMFORGE_NO_BROWSER_INSTALL:-}" ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: no Chromium and no way to install it here (root with apt-get): the report's browser test will skip"
  exit 0
fi
echo "setup: installing Debian's chromium for the report's browser test (once)"
export DEBIAN_FRONTEND=noninteractive
install() { timeout 900 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }
# A fresh machine's package lists may be missing or old: refresh them only if the first try fails.
if ! install && ! { timeout 300 apt-get update -qq >/dev/null 2>&1 && install; }; then
  echo "setup: apt-get could not install chromium: the report's browser test will skip"
  exit 0
fi
echo "setup: installed $(command -v chromium)"
exit 0
