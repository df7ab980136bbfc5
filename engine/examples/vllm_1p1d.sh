#!/usr/bin/env bash
# 1 prefill + 1 decode vLLM instance (vLLM 0.33.0) moving KV with xfer. Run each block on its host
# (or both on one host with listen_host 127.0.0.1 and different ports / GPUs).
# Addresses below are placeholders for your own hosts.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}

# --- prefill host (10.0.0.1): also hosts the xfer metadata store (host_store: true) ---
CUDA_VISIBLE_DEVICES=0 vllm serve "$MODEL" --port 8100 \
  --kv-transfer-config "$(cat "$(dirname "$0")/vllm_prefill.json")" &

# --- decode host (10.0.0.2) ---
CUDA_VISIBLE_DEVICES=1 vllm serve "$MODEL" --port 8200 \
  --kv-transfer-config "$(cat "$(dirname "$0")/vllm_decode.json")" &

# --- the proxy (any host): two calls per request, kv_transfer_params forwarded verbatim ---
python "$(dirname "$0")/pd_proxy.py" --port 8000 --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 &
# curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
#   -d '{"model": "'$MODEL'", "prompt": "San Francisco is a", "max_tokens": 32}'
# Across hosts every instance needs xfer's UCX transport: pip install "xfer[ucx]" (see README.md here).
wait
