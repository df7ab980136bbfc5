#!/usr/bin/env bash
# 1 prefill + 1 decode SGLang instance (SGLang 0.5.23) with xfer as the transfer backend.
# SGLang's backend list is closed: xfer takes the place of "mooncake" (--replace picks another).
# The prefill bootstrap server (--disaggregation-bootstrap-port) hosts xfer's metadata store.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
export XFER_SGLANG_TIMEOUT_S=30            # the deadline of every network step: look-up, connect, message,
                                           # layer transfer, liveness probe of a prefill a request waits on
# across hosts: pip install "xfer[ucx]" on every host
export XFER_SGLANG_HOST=10.0.0.1           # the address peers reach this instance's xfer agents on

python -m xfer.engine.sglang_plugin --replace mooncake -- --model-path "$MODEL" \
  --disaggregation-mode prefill --port 30000 --disaggregation-bootstrap-port 8998 --host 10.0.0.1 &

XFER_SGLANG_HOST=10.0.0.2 python -m xfer.engine.sglang_plugin --replace mooncake -- --model-path "$MODEL" \
  --disaggregation-mode decode --port 30001 --host 10.0.0.2 &

# the router pairs them as for any SGLang PD backend
python -m sglang_router.launch_router --pd-disaggregation \
  --prefill http://10.0.0.1:30000 8998 --decode http://10.0.0.2:30001 --port 8000 &
wait
