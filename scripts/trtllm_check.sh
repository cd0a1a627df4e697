#!/usr/bin/env bash
# The TensorRT-LLM >= 1.3 deployment on a GPU host where tensorrt_llm imports (the Dockerfile's
# `trtllm` stage): `paradraft build --backend trtllm`, then one streamed request, the
# acceptance read from the response, the server stopped. Bounded: READY_TIMEOUT for start-up,
# REQUEST_TIMEOUT for the request, 60 s to stop.
# Usage: scripts/trtllm_check.sh serve OUT_DIR    trtllm-serve with the YAML (OpenAI API)
#        scripts/trtllm_check.sh triton OUT_DIR   tritonserver with the llmapi repository, a
#                                                 stock tritonclient gRPC stream
#        scripts/trtllm_check.sh triton-missing   prints why the triton check cannot run (or
#                                                 nothing)
# Env: TRTLLM_VERIFIER / TRTLLM_DRAFT (HF dirs; default the demo pair; the draft defaults to the
#      verifier itself when only TRTLLM_VERIFIER is set: greedy acceptance is then ~1),
#      TRTLLM_BUILD_ARGS (more build flags, e.g. "--drafter ngram"), PARADRAFT, PYTHON,
#      TRTLLM_PORT (default 18100), READY_TIMEOUT (default 900), REQUEST_TIMEOUT (default 300).
# shellcheck disable=SC2317
set -u

cd "$(dirname "$0")/.." || exit 1
MODE=${1:-serve}
OUT=${2:-out/trtllm_check}
if [ -x .venv/bin/paradraft ]; then
    PARADRAFT=${PARADRAFT:-.venv/bin/paradraft}
    PYTHON=${PYTHON:-.venv/bin/python}
else
    PARADRAFT=${PARADRAFT:-paradraft}
    PYTHON=${PYTHON:-python3}
fi
PORT=${TRTLLM_PORT:-18100}
READY_TIMEOUT=${READY_TIMEOUT:-900}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-300}
SERVER_PID=""

triton_missing() {
    local bin
    bin=$("$PYTHON" -c "from paradraft.runtime.serving.server import find_tritonserver
print(find_tritonserver())" 2>/dev/null) || { echo "no tritonserver (PARADRAFT_TRITONSERVER)"; return; }
    "$PYTHON" -c "import tritonclient.grpc" 2>/dev/null || { echo "no tritonclient"; return; }
    local src=${PARADRAFT_TRTLLM_SRC:-/opt/tensorrt_llm_src}
    [ -f "$src/triton_backend/all_models/llmapi/tensorrt_llm/1/model.py" ] \
        || { echo "no llmapi model.py under $src (PARADRAFT_TRTLLM_SRC)"; return; }
    [ -x "$bin" ] || echo "tritonserver $bin is not executable"
}

stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -INT "$SERVER_PID"
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
        wait "$SERVER_PID" 2>/dev/null
    fi
    SERVER_PID=""
}
trap stop_server EXIT

wait_http() {  # wait_http URL: 200 from URL while the server lives, within READY_TIMEOUT
    local deadline=$(( $(date +%s) + READY_TIMEOUT ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited"; return 1; }
        "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
            "$1" 2>/dev/null && return 0
        sleep 2
    done
    echo "not ready within ${READY_TIMEOUT} s"
    return 1
}

build() {  # build DIR: the deployment for the chosen pair
    local models=()
    if [ -n "${TRTLLM_VERIFIER:-}" ]; then
        models=(--verifier "$TRTLLM_VERIFIER" --draft "${TRTLLM_DRAFT:-$TRTLLM_VERIFIER}")
    fi
    # shellcheck disable=SC2086
    "$PARADRAFT" build --backend trtllm --gpus 1 --precision bf16 --max-batch-size 4 --max-k 4 \
        --max-seq-len 1024 --out "$1" "${models[@]}" ${TRTLLM_BUILD_ARGS:-}
}

check_serve() {
    local dir="$OUT/deploy_serve"
    build "$dir" || return 1
    bash "$dir/serve_trtllm.sh" --port "$PORT" >"$OUT/trtllm_serve_process.log" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$PORT/health" || return 1
    timeout "$REQUEST_TIMEOUT" "$PYTHON" - "$PORT" <<'PY' || return 1
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0,
        "stream": True}
req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json", "X-TRTLLM-return-metrics": "1"})
text, spec = "", None
for line in urllib.request.urlopen(req):
    line = line.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    for choice in json.loads(line[6:]).get("choices", []):
        text += choice.get("text") or ""
        spec = choice.get("speculative_decoding") or spec
where = "stream"
if spec is None:  # older trtllm-serve: the per-request metrics endpoint
    where = "/perf_metrics"
    for item in json.load(urllib.request.urlopen(base + "/perf_metrics")):
        spec = item.get("perf_metrics", {}).get("speculative_decoding") or spec
print("text:", repr(text))
print("speculative_decoding (from", where + "):", spec)
assert text, "no text streamed"
assert spec is not None and "acceptance_rate" in spec, "no acceptance in the response"
print("acceptance_rate:", spec["acceptance_rate"])
PY
}

check_triton() {
    local reason
    reason=$(triton_missing)
    [ -z "$reason" ] || { echo "cannot run: $reason"; return 1; }
    local dir="$OUT/deploy_triton" grpc=$((PORT + 1)) http=$((PORT + 2)) metrics=$((PORT + 3))
    build "$dir" || return 1
    TRITONSERVER=$("$PYTHON" -c "from paradraft.runtime.serving.server import find_tritonserver
print(find_tritonserver())") bash "$dir/serve_triton_llmapi.sh" --grpc-port="$grpc" \
        --http-port="$http" --metrics-port="$metrics" >"$OUT/triton_llmapi_process.log" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$http/v2/health/ready" || return 1
    timeout "$REQUEST_TIMEOUT" "$PYTHON" - "$grpc" <<'PY' || return 1
import queue, sys
import numpy as np
import tritonclient.grpc as grpc
client = grpc.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}")
def tensor(name, value, dtype, np_dtype):
    t = grpc.InferInput(name, [1], dtype)
    t.set_data_from_numpy(np.array([value], dtype=np_dtype))
    return t
results = queue.Queue()
client.start_stream(callback=lambda result, error: results.put((result, error)))
client.async_stream_infer("tensorrt_llm", [
    tensor("text_input", b"def fibonacci(n):", "BYTES", np.object_),
    tensor("streaming", True, "BOOL", np.bool_),
    tensor("sampling_param_max_tokens", 32, "INT32", np.int32),
    tensor("sampling_param_temperature", 0.0, "FP32", np.float32),
    tensor("sampling_param_return_perf_metrics", True, "BOOL", np.bool_)],
    enable_empty_final_response=True)
text, rate = "", None
while True:
    result, error = results.get(timeout=240)
    assert error is None, error
    if result.get_response().parameters["triton_final_response"].bool_param:
        break
    text += "".join(x.decode() for x in result.as_numpy("text_output").reshape(-1))
    if result.as_numpy("acceptance_rate") is not None:
        rate = float(np.asarray(result.as_numpy("acceptance_rate")).reshape(-1)[0])
client.stop_stream()
print("text:", repr(text))
assert text, "no text streamed"
assert rate is not None, "no acceptance_rate in the responses"
print("acceptance_rate:", rate)
PY
}

mkdir -p "$OUT"
case "$MODE" in
    serve) check_serve ;;
    triton) check_triton ;;
    triton-missing) triton_missing ;;
    *) echo "usage: $0 serve|triton OUT_DIR | triton-missing" >&2; exit 2 ;;
esac
