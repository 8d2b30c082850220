#!/usr/bin/env bash
# Start a loopback pipeline: ./run_loopback.sh 2|3 [MODEL_DIR] [HTTP_PORT]
# Stages and the coordinator are separate processes on 127.0.0.x; Ctrl-C stops them all, each
# after draining what it holds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
n="${1:-2}"
config="$here/pipeline_${n}stage.toml"
model_args=()
[ -n "${2:-}" ] && model_args=(-m "$2")
port="${3:-8080}"
[ -f "$here/cluster.secret" ] || python -m mlxcel keygen --out "$here/cluster.secret"
# Each node in a process group of its own (job control), so a Ctrl-C in this terminal reaches
# this script only; it then sends every node exactly one SIGTERM: drain, then stop. (A second
# signal tells a node to stop at once.)
set -m
pids=()
stopping=0
stop() {
    [ "$stopping" = 1 ] && return
    stopping=1
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait || true
}
trap stop INT TERM EXIT
for ((i = 0; i < n; i++)); do
    python -m mlxcel serve "${model_args[@]}" --distributed-config "$config" --node-id "stage-$i" &
    pids+=($!)
done
python -m mlxcel serve "${model_args[@]}" --distributed-config "$config" --node-id coordinator --port "$port" &
pids+=($!)
wait -n || true
