#!/bin/sh
# NVIDIA's model-analyzer, unmodified, against a running rayinfer (--triton-launch-mode=remote):
# a brute-force sweep of one example model's configs (instance count 1-2, max_batch_size 1-2,
# dynamic batching, concurrency 1-2), each variant loaded through rayinfer's model load API.
#
#   benchmarks/model_analyzer.sh [MODEL]        # default: simple
#
# Installs triton-model-analyzer into its own virtualenv (benchmarks/results/ma-venv: its
# dependencies are not the server's), writes the example repository, starts `rayinfer serve` in
# explicit mode inside a private network namespace, runs `model-analyzer profile` and prints
# its results table. perf_analyzer: $PERF_ANALYZER, else ../shared/anchors/triton/perf_analyzer.
# Reports: benchmarks/results/model-analyzer/export.
set -eu
cd "$(dirname "$0")/.."
model=${1:-simple}
out=$PWD/benchmarks/results/model-analyzer
perf_analyzer=${PERF_ANALYZER:-$PWD/../shared/anchors/triton/perf_analyzer}
if [ "$(ip -o link | wc -l)" != 1 ]; then
    [ -x benchmarks/results/ma-venv/bin/model-analyzer ] || {
        python3 -m venv benchmarks/results/ma-venv
        benchmarks/results/ma-venv/bin/pip install -q triton-model-analyzer
    }
    exec unshare -n "$0" "$@"
fi
ip link set lo up
rm -rf "$out" && mkdir -p "$out"
.venv/bin/rayinfer example-repository "$out/repo" > /dev/null
# KIND_CPU variants: model-analyzer would otherwise try KIND_GPU ones, which wait for GPUs here.
printf 'profile_models:\n  %s:\n    cpu_only: true\n' "$model" > "$out/config.yaml"
RAY_worker_niceness=0 .venv/bin/rayinfer serve --model-repository "$out/repo" --model-control-mode explicit \
    --load-model "$model" > "$out/rayinfer.log" 2>&1 &
server=$!
trap 'kill -INT $server; wait $server' EXIT
waited=0
until curl -sf localhost:8000/v2/health/ready > /dev/null; do
    kill -0 $server && [ $waited -lt 300 ] || { echo "rayinfer not ready"; tail -20 "$out/rayinfer.log"; exit 1; }
    sleep 1  # polled, with a 300 s deadline
    waited=$((waited + 1))
done
benchmarks/results/ma-venv/bin/model-analyzer profile -f "$out/config.yaml" --triton-launch-mode=remote \
    --triton-http-endpoint 127.0.0.1:8000 --triton-grpc-endpoint 127.0.0.1:8001 \
    --triton-metrics-url http://127.0.0.1:8002/metrics --model-repository "$out/repo" \
    --output-model-repository-path "$out/variants" --override-output-model-repository \
    --perf-analyzer-path "$perf_analyzer" --run-config-search-max-instance-count 2 \
    --run-config-search-max-model-batch-size 2 --run-config-search-max-concurrency 2 \
    --export-path "$out/export" -s "$out/checkpoints" > "$out/model-analyzer.log" 2>&1
grep -c "Profiling ${model}_config" "$out/model-analyzer.log" | sed 's/^/measurements: /'
cat "$out/export/results/metrics-model-inference.csv"
