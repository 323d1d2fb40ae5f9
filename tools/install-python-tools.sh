#!/usr/bin/env bash
# Creates, once, the Python environment the tests read our files back with: TensorBoard's
# event-file loader (tensorboard, from PyPI by pip) in target/py-tools. Idempotent (a second
# run does nothing); a machine without python3's venv module or without PyPI says so and the
# tests that need it skip.
set -uo pipefail
cd "$(dirname "$0")/.."
env=target/py-tools
[ -f "$env/.installed" ] && exit 0
if ! python3 -m venv "$env" >/dev/null 2>&1; then
  echo "note: python3 -m venv failed (Debian: apt-get install python3-venv); the TensorBoard read-back test skips" >&2
  exit 0
fi
if "$env/bin/pip" install --quiet --disable-pip-version-check "tensorboard==2.21.0"; then
  touch "$env/.installed"
else
  echo "note: pip could not install tensorboard; the TensorBoard read-back test skips" >&2
fi
