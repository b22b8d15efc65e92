#!/usr/bin/env bash
# One prepared GPU check (issue: Triton kernels and the GPU fast path). Under 8 minutes on an
# H200: kernel tests on CUDA, kernel accuracy/bandwidth table, decode step + prefill table.
#   bash bench/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== kernel tests on CUDA"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels -x 2>&1 | tail -5
echo "== kernels vs references, bandwidth, prefill attention"
timeout 120 python3 bench/kernels.py
echo "== decode step (CUDA graphs) and prefill, Llama-3.1-8B shape"
timeout 240 python3 bench/decode_step.py
