#!/usr/bin/env bash
# Install mlxcel's GPU dependencies on a lent H200 machine (see ../shared/gpu.md): the first
# half of the mlx-cuda wheel waits in /tmp/p (copied there by an earlier command from .gpu/),
# the second half and the other wheels travel in .gpu2/. Source this script:
#   . tools/h200_setup.sh
set -e
if [ ! -d /tmp/site/mlx ]; then
  cat /tmp/p/cuda.part.aa .gpu2/cuda.part.ab > /tmp/p/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site \
    /tmp/p/mlx_cuda_13-*.whl .gpu2/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 MLXCEL_HOME=/tmp/mh PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
python3 -c 'import mlx.core as mx; print("mlx device:", mx.default_device())'
set +e
