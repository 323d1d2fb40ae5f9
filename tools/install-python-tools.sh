#!/usr/bin/env bash
# Creates, once, the Python environment the tests read our files back with, in
# target/py-tools, from PyPI by pip: TensorBoard's event-file loader (tensorboard) and MLflow's
# tracking client (mlflow-skinny, which reads the mlruns/ file store). Idempotent: each
# package is installed once (a marker per package), so a second run does nothing. A machine
# without python3's venv module or without PyPI says so, and the tests that need them skip.
set -uo pipefail
cd "$(dirname "$0")/.."
env=target/py-tools
if [ ! -x "$env/bin/pip" ] && ! python3 -m venv "$env" >/dev/null 2>&1; then
  echo "note: python3 -m venv failed (Debian: apt-get install python3-venv); the TensorBoard and MLflow read-back tests skip" >&2
  exit 0
fi
# An environment made before the markers were per package had tensorboard.
[ -f "$env/.installed" ] && [ ! -f "$env/.installed-tensorboard" ] && touch "$env/.installed-tensorboard"
for spec in "tensorboard==2.21.0" "mlflow-skinny==3.18.0"; do
  name=${spec%%==*}
  [ -f "$env/.installed-$name" ] && continue
  if "$env/bin/pip" install --quiet --disable-pip-version-check "$spec"; then
    touch "$env/.installed-$name"
  else
    echo "note: pip could not install $spec; the test that reads our files back with it skips" >&2
  fi
done
