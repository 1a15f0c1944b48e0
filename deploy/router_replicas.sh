#!/usr/bin/env bash
# N `jaxpaged serve` replicas on this machine behind vLLM's router, each replica on its own GPUs
# and publishing its KV events, the router's kv_aware policy sending each request to the replica
# that holds its prefix. A replica that dies is started again (the router takes it back once its
# health check passes); Ctrl-C or SIGTERM stops everything.
#
#   deploy/router_replicas.sh MODEL N [more jaxpaged serve flags]
#
# Environment (defaults): PORT (8000: the router), FIRST_PORT (8001: replica r serves on
# FIRST_PORT + r), EVENTS_PORT (5557: replica r publishes on EVENTS_PORT + r), GPUS_PER_REPLICA
# (1: replica r sees GPUs r*G .. r*G+G-1; use --tensor-parallel-size G with G > 1),
# SERVED_MODEL_NAME (model), BLOCK_SIZE (16), POLICY (kv_aware), ROUTER (vllm-router),
# JAXPAGED (jaxpaged). Needs `pip install vllm-router` and jaxpaged's server extra.
# Prints "replica R pid P port Q" each time it starts a replica, then "router pid P port Q".
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL N [jaxpaged serve flags]" >&2
    exit 2
fi
model=$1 replicas=$2
shift 2
port=${PORT:-8000} first_port=${FIRST_PORT:-8001} events_port=${EVENTS_PORT:-5557}
gpus=${GPUS_PER_REPLICA:-1} name=${SERVED_MODEL_NAME:-model} block_size=${BLOCK_SIZE:-16}
policy=${POLICY:-kv_aware} router=${ROUTER:-vllm-router} jaxpaged=${JAXPAGED:-jaxpaged}

stopping=0
children=()
stop() {
    stopping=1
    kill -TERM "${children[@]}" 2>/dev/null || true
}
trap stop INT TERM

# Replica $1 (then the serve flags), started again whenever it dies, until this script stops;
# a replica refusing its flags (exit 2) stops everything instead.
keep_serving() {
    local rank=$1 first_gpu=$(($1 * gpus)) devices="" pid status
    shift
    for ((g = first_gpu; g < first_gpu + gpus; g++)); do devices+="${devices:+,}$g"; done
    local events="{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:$((events_port + rank))\"}"
    trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; exit 0' TERM
    while true; do
        CUDA_VISIBLE_DEVICES=$devices "$jaxpaged" serve "$model" --served-model-name "$name" \
            --host 127.0.0.1 --port $((first_port + rank)) --block-size "$block_size" \
            --kv-events-config "$events" "$@" &
        pid=$!
        echo "replica $rank pid $pid port $((first_port + rank))"
        status=0
        wait "$pid" || status=$?
        if [ "$status" = 2 ]; then
            echo "replica $rank refused its flags (exit 2); stopping" >&2
            kill -TERM $$
            exit 2
        fi
        sleep 1
    done
}

workers=() sources=()
for ((r = 0; r < replicas; r++)); do
    keep_serving "$r" "$@" &
    children+=($!)
    workers+=("http://127.0.0.1:$((first_port + r))")
    sources+=(--kv-event-source "http://127.0.0.1:$((first_port + r))=tcp://127.0.0.1:$((events_port + r))")
done

kv_flags=()
if [ "$policy" = kv_aware ]; then
    kv_flags=("${sources[@]}" --kv-event-model "$name" --kv-event-block-size "$block_size")
fi
# The router waits for every worker's /health (compiling takes minutes on a cold cache).
"$router" --host 0.0.0.0 --port "$port" --policy "$policy" --health-check-interval-secs 5 --cb-timeout-duration-secs 10 \
    --worker-startup-timeout-secs 1800 --worker-urls "${workers[@]}" "${kv_flags[@]}" &
children+=($!)
echo "router pid $! port $port"
while [ "$stopping" = 0 ]; do
    wait -n || true
    if ! kill -0 "${children[-1]}" 2>/dev/null; then # the router itself exited
        stop
    fi
done
wait
