#!/usr/bin/env bash
# The one prepared GPU check. Every test file runs on its own (no -x: one failure never hides
# the next file), then every benchmark; each step has its own timeout and a failure prints and
# the script goes on. Sections are chosen by name, so a rerun repeats only the failed ones:
#
#   bash bench/gpu_check.sh                       # all sections, about 6 minutes on an H200
#   bash bench/gpu_check.sh decode prefill        # only these
#   LOG=path bash bench/gpu_check.sh ...          # default bench/logs/2026-11-30-gpu_check.log
#
# sections: env kernels decode decode_step prefill quant moe
# The whole output (stdout and stderr of every step) goes to the terminal and to one raw log,
# committed beside bench/RESULTS.md (its tables are copied from that log, never retyped).
# PDSERVE_TORCH_PEER: path of the plain-torch CUDA-graph peer decode_step runs beside
# pdserve (default: shared/anchors/ or ../shared/anchors/gpu_torch_graph_decode.py; the
# peer's row says so when it is found nowhere).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG=${LOG:-bench/logs/2026-11-30-gpu_check.log}
mkdir -p "$(dirname "$LOG")"
exec > >(tee -a "$LOG") 2>&1
SECTIONS=${*:-env kernels decode decode_step prefill quant moe}
PEER=${PDSERVE_TORCH_PEER:-}
for p in shared/anchors/gpu_torch_graph_decode.py ../shared/anchors/gpu_torch_graph_decode.py; do
    [ -z "$PEER" ] && [ -e "$p" ] && PEER=$p
done

# step SECONDS NAME FILE COMMAND...: run COMMAND under a timeout unless FILE is missing
step() {
    local secs=$1 name=$2 file=$3
    shift 3
    if [ -n "$file" ] && [ ! -e "$file" ]; then
        echo "-- $name: SKIPPED ($file not on this branch)"
        return
    fi
    echo "-- $name ($(date -u +%T), limit ${secs}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$secs" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then
        echo "-- $name: OK in $((SECONDS - t0))s"
    else
        echo "-- $name: FAILED rc=$rc in $((SECONDS - t0))s$([ $rc -eq 124 ] && echo ' (timeout)')"
    fi
}

# tests FILE SECONDS: one pytest file, every test reported (-rfEs), never -x
tests() { step "$2" "pytest $1" "$1" python3 -m pytest -q -rfEs -p no:cacheprovider "$1"; }

for s in $SECTIONS; do
    echo
    echo "==== section $s"
    case $s in
    env)
        nvidia-smi --query-gpu=name,memory.total,driver_version,power.draw --format=csv,noheader || true
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
        git log -1 --format='commit %H %s' 2>/dev/null || true
        ;;
    kernels)
        tests tests/kernels/test_decode_attention.py 90
        tests tests/kernels/test_pointwise_kernels.py 60
        tests tests/kernels/test_dispatch.py 30
        tests tests/kernels/test_rotary_kv.py 45
        step 90 "bench/kernels.py" bench/kernels.py python3 bench/kernels.py
        ;;
    decode)
        tests tests/kernels/test_cuda_graphs.py 90
        tests tests/kernels/test_engine_triton.py 60
        tests tests/kernels/test_device_sampler.py 45
        tests tests/unit/test_decode_graphs.py 45
        ;;
    decode_step)
        step 150 "bench/decode_step.py" bench/decode_step.py python3 bench/decode_step.py --peer "$PEER"
        ;;
    prefill)
        tests tests/kernels/test_prefill_attention.py 60
        step 40 "pytest test_kvtransfer_state -k cuda" tests/unit/test_kvtransfer_state.py \
            python3 -m pytest -q -rfEs -p no:cacheprovider tests/unit/test_kvtransfer_state.py -k cuda
        step 80 "bench/disagg_gpu.py" bench/disagg_gpu.py python3 bench/disagg_gpu.py --budget-s 58
        ;;
    quant)
        tests tests/kernels/test_quant_matmul.py 60
        step 60 "bench/quant.py --gpu" bench/quant.py python3 bench/quant.py --gpu
        ;;
    moe)
        tests tests/kernels/test_moe.py 60
        step 90 "pytest tests/unit/test_quant_moe.py -k cuda" tests/unit/test_quant_moe.py \
            python3 -m pytest -q -rfEs -p no:cacheprovider tests/unit/test_quant_moe.py -k cuda
        step 60 "bench/moe.py --gpu" bench/moe.py python3 bench/moe.py --gpu
        ;;
    *)
        echo "unknown section $s (known: env kernels decode decode_step prefill quant moe)"
        ;;
    esac
done
echo
echo "==== done $(date -u +%T)"
