#!/usr/bin/env bash
# The GPU checks, on a host (or in the Dockerfile's image) with an NVIDIA GPU:
#   nvidia-smi; the GPU correction kernel's tests on the GPU (TRITON_INTERPRET unset); the
#   torch runtime on CUDA in bf16 (tests/test_cuda.py, generate --device cuda); TensorRT
#   engines for the demo pair; the fused (in-engine) correction against the unfused path;
#   bench with the efficiency column (TensorRT fused on/off, torch CUDA bf16); captured
#   (CUDA graph) steps against eager (lab/compile_cost.py); the backend
#   conformance suite; a Triton serve + query + loadtest
#   smoke on those engines; where tensorrt_llm imports, the TensorRT-LLM >= 1.3 deployment
#   (trtllm-serve and Triton llmapi, scripts/trtllm_check.sh) or, <= 1.2.1, the legacy engines.
# Every step runs (a failure does not stop the rest), is timed, and logs to $OUT/<step>.log;
# one summary table at the end; the exit status is 1 when any step failed.
# Usage: scripts/gpu_check.sh [OUT_DIR]     (default out/gpu_check)
# Env: PARADRAFT, PYTHON (default .venv/bin/* when present, else from PATH),
#      GRPC_PORT / HTTP_PORT / METRICS_PORT (default 18001 / 18000 / 18002),
#      READY_TIMEOUT (seconds to wait for the server, default 600),
#      COMPILE_BUDGET (seconds the captured-steps step starts blocks in, default 300).
# The functions below run through `step` and the EXIT trap, which shellcheck cannot follow:
# shellcheck disable=SC2317
set -u

cd "$(dirname "$0")/.." || exit 1
OUT=${1:-out/gpu_check}
mkdir -p "$OUT"
if [ -x .venv/bin/paradraft ]; then
    PARADRAFT=${PARADRAFT:-.venv/bin/paradraft}
    PYTHON=${PYTHON:-.venv/bin/python}
else
    PARADRAFT=${PARADRAFT:-paradraft}
    PYTHON=${PYTHON:-python3}
fi
GRPC_PORT=${GRPC_PORT:-18001}
HTTP_PORT=${HTTP_PORT:-18000}
METRICS_PORT=${METRICS_PORT:-18002}
READY_TIMEOUT=${READY_TIMEOUT:-600}
ENGINES="$OUT/engines_tensorrt"

NAMES=()
STATUSES=()
SECONDS_TAKEN=()
NOTES=()
SERVER_PID=""

now() {
    # EPOCHREALTIME (bash >= 5) gives sub-second timings; plain seconds otherwise
    if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s; fi
}

record() {  # record NAME STATUS SECONDS NOTE
    NAMES+=("$1")
    STATUSES+=("$2")
    SECONDS_TAKEN+=("$3")
    NOTES+=("$4")
    echo "== $1: $2 ($3 s) $4"
}

step() {  # step NAME COMMAND...: run it, log it, time it, record PASS / FAIL
    local name=$1 log t0 t1 status
    shift
    log="$OUT/$(echo "$name" | tr -c 'A-Za-z0-9_\n-' '_').log"
    echo "== $name: $*"
    t0=$(now)
    if "$@" >"$log" 2>&1; then status=PASS; else status=FAIL; fi
    t1=$(now)
    record "$name" "$status" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" \
        "log $log"
}

skip() {  # skip NAME REASON
    record "$1" SKIP "0.0" "$2"
}

stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -INT "$SERVER_PID"  # paradraft serve stops tritonserver cleanly on SIGINT
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
        wait "$SERVER_PID" 2>/dev/null
    fi
    SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # poll Triton's readiness endpoint while the server process lives
    local deadline=$(( $(date +%s) + READY_TIMEOUT ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        kill -0 "$SERVER_PID" 2>/dev/null || return 1
        if "$PYTHON" -c "import urllib.request; urllib.request.urlopen(
                'http://127.0.0.1:$HTTP_PORT/v2/health/ready', timeout=2)" 2>/dev/null; then
            return 0
        fi
        sleep 2
    done
    return 1
}

start_server() {
    "$PARADRAFT" serve --engines "$ENGINES" --grpc-port "$GRPC_PORT" --http-port "$HTTP_PORT" \
        --metrics-port "$METRICS_PORT" >"$OUT/serve_process.log" 2>&1 &
    SERVER_PID=$!
    wait_ready
}

# 1. the driver sees the GPU
step "nvidia-smi" nvidia-smi

# 2. the fused correction kernel compiled for this GPU against correction.correct (the CPU
# suite, tests/test_kernel.py, runs it in Triton's interpreter on CPU tensors instead)
step "kernel tests (GPU)" env -u TRITON_INTERPRET "$PYTHON" -m pytest -q tests/test_cuda.py \
    -k "kernel or ngram"

# 2b. the torch runtime on CUDA in bf16: greedy speculative == greedy plain for every drafter,
# and the exact rule's distribution test, eager and from captured CUDA graphs (--compile)
step "torch runtime (CUDA bf16)" "$PYTHON" -m pytest -q -rs tests/test_cuda.py
step "generate --device cuda" "$PARADRAFT" generate --device cuda --dtype bfloat16 \
    --prompt "def fibonacci(n):" --max-new-tokens 32 --json

# 3. TensorRT engines for the demo pair
# as many batch rows as `serve` has slots by default (16), or serve refuses the plans
HAS_TENSORRT=$("$PYTHON" -c "import tensorrt; print(tensorrt.__version__)" 2>/dev/null | tail -1)
if [ -n "$HAS_TENSORRT" ]; then
step "build tensorrt engines" "$PARADRAFT" build --backend tensorrt --max-batch-size 16 \
    --out "$ENGINES"
fi

# 3b. verify + correct in one TensorRT call (the CausalCorrection plugin): greedy output equals
# the unfused path token for token, and no round fell back
fused_check() {
    local common=(generate --engines "$ENGINES" --prompt "def fibonacci(n):" --rule greedy
                  --max-new-tokens 48 --ignore-eos --json)
    "$PARADRAFT" "${common[@]}" --fused-correction on >"$OUT/fused_on.json" || return 1
    "$PARADRAFT" "${common[@]}" --fused-correction off >"$OUT/fused_off.json" || return 1
    "$PYTHON" - "$OUT/fused_on.json" "$OUT/fused_off.json" <<'PY'
import json, sys
on, off = (json.load(open(f)) for f in sys.argv[1:3])
print("fused stats:", {k: on.get(k) for k in ("fused_rounds", "fused_fallback")})
assert on["token_ids"] == off["token_ids"], "fused and unfused greedy outputs differ"
assert on["fused_rounds"] > 0 and not on["fused_fallback"], "fell back"
PY
}
if [ -n "$HAS_TENSORRT" ]; then
    step "fused correction (tensorrt)" fused_check
else
    skip "build tensorrt engines" "tensorrt not importable"
    skip "fused correction (tensorrt)" "tensorrt not importable"
fi

# 3c. bench with the bound and efficiency columns: TensorRT engines (fused on and off) and the
# torch runtime on CUDA in bf16, batch 1 and 8, draft model and PARD, K=4
if [ -n "$HAS_TENSORRT" ]; then
    step "bench tensorrt (efficiency)" "$PARADRAFT" bench --backends tensorrt \
        --engines "$ENGINES" --drafters model,parallel --ks 4 --batch-sizes 1,8 \
        --fused-correction on,off --no-hf --out "$OUT/bench_tensorrt"
else
    skip "bench tensorrt (efficiency)" "tensorrt not importable"
fi
step "bench torch cuda (efficiency)" "$PARADRAFT" bench --backends torch --device cuda \
    --dtype bfloat16 --drafters model,parallel --ks 4 --batch-sizes 1,8 --no-hf \
    --out "$OUT/bench_torch_cuda"

# 3d. captured steps (runtime/compiled.py: torch.compile, CUDA graphs) against eager, bf16,
# random weights at SmolLM2's shape and a 1.5B (Qwen2.5-1.5B) shape, batch 1, 8, 32: the plain
# step eager vs captured, the verify pass of K + 1 positions in plain steps, speculative
# (n-gram) vs plain tok/s, both captured. COMPILE_BUDGET (seconds, default 300) bounds it:
# a block that would start later is listed as skipped in compile_cost.json (written after
# every block), and a run 3 minutes past the budget is stopped.
COMPILE_BUDGET=${COMPILE_BUDGET:-300}
step "captured steps (torch cuda)" timeout "$((COMPILE_BUDGET + 180))" "$PYTHON" \
    lab/compile_cost.py --device cuda --dtype bfloat16 --budget-s "$COMPILE_BUDGET" \
    --out "$OUT/compile_cost.json"

# 4. the same suite on every backend present (tensorrt included now)
step "conformance tests" env -u TRITON_INTERPRET "$PYTHON" -m pytest -q tests/test_conformance.py

# 5. serve the engines, query once (streaming), load test, stop (TensorRT engines and a
# tritonserver on the PATH or unpacked into .venv by `make serve-deps`)
if [ -n "$HAS_TENSORRT" ] && { command -v tritonserver >/dev/null \
        || [ -x .venv/pytriton/pytriton/tritonserver/bin/tritonserver ]; }; then
    step "serve (start + ready)" start_server
else
    skip "serve (start + ready)" "needs tensorrt and a tritonserver"
fi
if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    step "query" "$PARADRAFT" query --url "127.0.0.1:$GRPC_PORT" --prompt "def fibonacci(n):" \
        --max-tokens 32 --stream --json
    step "loadtest" "$PARADRAFT" loadtest --url "127.0.0.1:$GRPC_PORT" --concurrency 1,4,8 \
        --requests 16 --max-tokens 32 --out "$OUT/loadtest"
    step "serve (stop)" stop_server
else
    skip "query" "server not ready; see $OUT/serve_process.log"
    skip "loadtest" "server not ready"
fi

# 6. TensorRT-LLM, where it is installed. >= 1.3 (PyTorch backend only): the LLM API deployment
# served by trtllm-serve and by Triton's llmapi model, one streamed request each, acceptance
# read from the response (scripts/trtllm_check.sh; alone: scripts/trtllm_check.sh serve DIR).
# <= 1.2.1: the legacy engine build.
TRTLLM_VERSION=$("$PYTHON" -c "import tensorrt_llm; print(tensorrt_llm.__version__)" 2>/dev/null \
    | tail -1)
if [ -z "$TRTLLM_VERSION" ]; then
    skip "trtllm-serve (LLM API)" "tensorrt_llm not importable"
    skip "triton llmapi (gRPC)" "tensorrt_llm not importable"
elif "$PYTHON" -c "import sys; from paradraft.build.trtllm_engine import engine_era
sys.exit(engine_era(sys.argv[1]))" "$TRTLLM_VERSION"; then
    step "trtllm-serve (LLM API)" scripts/trtllm_check.sh serve "$OUT/trtllm"
    TRITON_MISSING=$(scripts/trtllm_check.sh triton-missing)
    if [ -z "$TRITON_MISSING" ]; then
        step "triton llmapi (gRPC)" scripts/trtllm_check.sh triton "$OUT/trtllm"
    else
        skip "triton llmapi (gRPC)" "$TRITON_MISSING"
    fi
else
    step "build trtllm engines (legacy)" "$PARADRAFT" build --backend trtllm \
        --trtllm-engine-legacy --out "$OUT/engines_trtllm"
fi

echo
printf '%-24s %-6s %8s  %s\n' "step" "status" "seconds" "note"
printf '%-24s %-6s %8s  %s\n' "----" "------" "-------" "----"
failed=0
for i in "${!NAMES[@]}"; do
    printf '%-24s %-6s %8s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${SECONDS_TAKEN[$i]}" \
        "${NOTES[$i]}"
    [ "${STATUSES[$i]}" = FAIL ] && failed=1
done
exit "$failed"
