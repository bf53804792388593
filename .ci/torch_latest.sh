#!/usr/bin/env bash
# The speed recipes' parity tests, and the test files of FSDP2's one-rank path, the Triton AdamW and
# FSDP2 against an unsharded model, on the newest torch release in a virtualenv of its own
# (.venv-torch-latest). `install` makes it, `test` runs them; no argument does both.
#   .ci/torch_latest.sh            # about 2 minutes to install (a CUDA build of torch, from PyPI), 2 to test
set -euo pipefail
cd "$(dirname "$0")/.."
LATEST=2.15.0   # the newest release pyproject.toml's range admits
VENV=.venv-torch-latest
FILES=(tests/integration/test_speed.py tests/integration/test_grad_upcast.py tests/integration/test_reduce_copy_in.py
       tests/integration/test_grad_squares.py tests/unit/test_one_rank.py tests/integration/test_kept_unshard.py
       tests/integration/test_kernel_adamw.py tests/integration/test_fsdp_parity.py tests/unit/test_compile_optim.py
       tests/unit/test_kernel_device.py tests/integration/test_startup.py tests/unit/test_tied_embedding_grad.py)
if [ "${1:-install}" = install ] || [ $# = 0 ]; then
  python3 -m venv "$VENV"
  # PIP_CONFIG_FILE=/dev/null: no pip config, so no local cap on torch's version (a CI machine's pip
  # config may pin it to the wheels on its disk); torch, Triton and the rest come from PyPI.
  # The CUDA build takes 6.2 GB in the venv (nvidia/ 3.0, torch 1.2, triton 1.0) and 8.3 GB of free
  # disk at the install's peak (2026-12-06, a clean clone); --no-cache-dir keeps pip from also
  # keeping the wheels, which a clean clone never installs again. A CI run once ended here with
  # ENOSPC, so the free disk is printed before and after a failure.
  df -h . | tail -1 | awk '{print "free disk before the install:", $4}'
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q --no-cache-dir --disable-pip-version-check "torch==$LATEST" -e . pytest pytest-xdist \
    || { df -h . | tail -1 | awk '{print "free disk after the failed install:", $4}'; exit 1; }
fi
if [ "${1:-test}" = test ] || [ $# = 0 ]; then
  "$VENV/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  "$VENV/bin/python" -m src.speed --markdown
  "$VENV/bin/python" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "${FILES[@]}"
fi
