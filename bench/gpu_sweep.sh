#!/usr/bin/env bash
# Synthetic reference sweep on one CUDA device (see bench/gpu_sweep.py); extra arguments pass through.
cd "$(dirname "$0")/.." && exec python bench/gpu_sweep.py "$@"
