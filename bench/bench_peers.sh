#!/usr/bin/env bash
# `pdserve bench` against llama.cpp's own llama-server and against `pdserve up`, both serving
# the default model (SmolLM2-135M-Instruct Q4_1 GGUF) on this machine, one after the other, the
# same load for both: the same table comes out of each. The raw output is the log.
#   bench/bench_peers.sh [BENCH ARGS...]    (default: --concurrency 4 --duration 30)
# llama-server: bench/build_llama_server.sh's cached binary, run as /work/shared/NOTES.md says
# (-t 2 -cb --parallel 32 -c 32768). pdserve up: its defaults (1 prefill + 1 decode + gateway).
set -euo pipefail
cd "$(dirname "$0")/.."
ARGS=("$@"); [[ ${#ARGS[@]} -gt 0 ]] || ARGS=(--concurrency 4 --duration 30)
THREADS="${LLAMA_THREADS:-2}"     # llama-server -t (NOTES.md: 2)
BIN="$(bench/build_llama_server.sh)"
MODEL="$(python3 -c 'from pdserve.default_model import resolve_default_model as r; print(r())')"
port() { python3 -c 'from pdserve.processes import free_port; print(free_port())'; }
LOGS="$(mktemp -d /tmp/bench-peers-XXXXXX)"
PID=""
stop() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; }
trap stop EXIT
ready() {   # ready URL SECONDS: poll until it answers 200 (bounded)
  local deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    (( SECONDS < deadline )) || { echo "not ready in $2 s: $1" >&2; return 1; }
    kill -0 "$PID" 2>/dev/null || { echo "server exited" >&2; return 1; }
    sleep 0.5
  done
}
echo "# bench_peers $(date -u '+%Y-%m-%d %H:%M:%S UTC'); $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# model $MODEL; pdserve bench ${ARGS[*]}"
echo "# logs: $LOGS"

P=$(port)
echo; echo "## llama.cpp llama-server ($("$BIN" --version 2>&1 | head -1)): -t $THREADS -cb --parallel 32 -c 32768"
"$BIN" -m "$MODEL" -t "$THREADS" -cb --parallel 32 -c 32768 --host 127.0.0.1 --port "$P" \
  > "$LOGS/llama-server.log" 2>&1 &
PID=$!
ready "http://127.0.0.1:$P/health" 120
python3 -m pdserve.cli bench --url "http://127.0.0.1:$P" "${ARGS[@]}" --no-progress
stop
echo "llama-server's own timings of the last requests (its print_timing lines), to check the table by:"
grep -E "prompt eval time|  eval time" "$LOGS/llama-server.log" | tail -n 6 | sed 's/^.*| task/  task/'

P=$(port)
echo; echo "## pdserve up (default model, 1 prefill + 1 decode + gateway, its default threads)"
python3 -m pdserve.cli up --http-port "$P" --grpc-port 0 > "$LOGS/pdserve-up.log" 2>&1 &
PID=$!
ready "http://127.0.0.1:$P/health" 300
python3 -m pdserve.cli bench --url "http://127.0.0.1:$P" "${ARGS[@]}" --no-progress
stop
echo; echo "# done $(date -u '+%H:%M:%S UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
