#!/usr/bin/env bash
# 2 prefill instances (TP 2 each) + 2 decode instances (TP 1 each), vLLM 0.33.0 + xfer.
# Every instance names the same metadata store; engine_id must be unique per instance. A decode
# rank reads the kv heads it holds from the prefill ranks holding them (peer_tp_size tells each
# side the other side's TP size; all prefill instances share one TP size, all decode ones another).
# The proxy picks one prefill and one decode instance per request (round robin, least loaded...)
# and forwards kv_transfer_params from the prefill response to the decode request, as in 1P1D.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
STORE=tcp://10.0.0.1:29600

cfg() {  # role engine_id listen_host peer_tp
  printf '{"kv_connector":"XferConnector","kv_connector_module_path":"xfer.engine.vllm_connector",'
  printf '"kv_role":"%s","engine_id":"%s","kv_load_failure_policy":"recompute",' "$1" "$2"
  printf '"kv_connector_extra_config":{"store":"%s","host_store":%s,"listen_host":"%s","peer_tp_size":%s}}' \
    "$STORE" "$([ "$2" = prefill-0 ] && echo true || echo false)" "$3" "$4"
}

# prefill host A (10.0.0.1), GPUs 0-3: two TP-2 instances
CUDA_VISIBLE_DEVICES=0,1 vllm serve "$MODEL" --port 8100 -tp 2 --kv-transfer-config "$(cfg kv_producer prefill-0 10.0.0.1 1)" &
CUDA_VISIBLE_DEVICES=2,3 vllm serve "$MODEL" --port 8101 -tp 2 --kv-transfer-config "$(cfg kv_producer prefill-1 10.0.0.1 1)" &
# decode host B (10.0.0.2), GPUs 0-1: two TP-1 instances
CUDA_VISIBLE_DEVICES=0 vllm serve "$MODEL" --port 8200 --kv-transfer-config "$(cfg kv_consumer decode-0 10.0.0.2 2)" &
CUDA_VISIBLE_DEVICES=1 vllm serve "$MODEL" --port 8201 --kv-transfer-config "$(cfg kv_consumer decode-1 10.0.0.2 2)" &
# the proxy: each request to the next prefill and the next decode instance
python "$(dirname "$0")/pd_proxy.py" --port 8000 --prefill http://10.0.0.1:8100 --prefill http://10.0.0.1:8101 \
  --decode http://10.0.0.2:8200 --decode http://10.0.0.2:8201 &
wait
# Across hosts xfer picks UCX (pip install "xfer[ucx]" on every host); for InfiniBand/RoCE export the UCX settings from README.md
# ("Across nodes with UCX") in every instance's environment.
