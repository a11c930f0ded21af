#!/usr/bin/env bash
# The one GPU check (bench/gpu_check.py) for one device call; --smoke runs it tiny on the CPU (CI).
# On the device machine torch is installed but diffusers and torchao are not: carried wheels in
# .whl/ (see bench/README.md) are installed aside, and a plain checkout is exposed under its
# package name. Arguments pass through; PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if [ -d .whl ] && ! "$py" -c "import diffusers" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -c "import segmented_checkpointing" 2>/dev/null; then
  mkdir -p /tmp/segckpt-path && ln -sfn "$PWD" /tmp/segckpt-path/segmented_checkpointing
  export PYTHONPATH="/tmp/segckpt-path${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$py" bench/gpu_check.py "$@"
