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

# --- the proxy: two calls per request (any P/D proxy that forwards kv_transfer_params works,
# e.g. vLLM's disaggregated-serving toy proxy written for NixlConnector) ---
# 1. prefill: max_tokens=1 and kv_transfer_params {"do_remote_decode": true}
#    curl -s 10.0.0.1:8100/v1/completions -H 'content-type: application/json' -d '{"model": "'$MODEL'",
#      "prompt": "...", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}'
#    -> the response carries kv_transfer_params: remote_engine_id, remote_request_id, remote_block_ids,
#       remote_tp_size, lease_expires (the prefill blocks stay held until the decode side read them,
#       or until lease_s passes)
# 2. decode: the same request with the returned kv_transfer_params, verbatim
#    curl -s 10.0.0.2:8200/v1/completions -d '{..., "kv_transfer_params": <from step 1>}'
wait
