#!/usr/bin/env bash
# Synthetic reference sweep on one CUDA device (bench/gpu_sweep.py); arguments pass through, PYTHON overrides the interpreter.
cd "$(dirname "$0")/.." && exec "${PYTHON:-python}" bench/gpu_sweep.py "$@"
