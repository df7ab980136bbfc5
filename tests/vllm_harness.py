"""vLLM 0.33 instances on CPU for the connector tests: the real v1 ``Scheduler`` and
``allocate_kv_cache``, the worker-side connector driven in the model runner's call order
(``KVConnectorModelRunnerMixin._get_kv_connector_output``), and a prefill instance in its own
process (``python tests/vllm_harness.py prefill ...``) that a test can freeze with SIGSTOP.

Imports vLLM: only the opt-in tests (and the child process) use it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is a local config.json: never ask the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        KVCacheTensor, MLAAttentionSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

BS, LAYERS, BLOCKS, HEADS, HEAD = 4, 2, 24, 2, 8
EOS = 255
POISON = 0x5A


def write_tiny_model(d) -> str:
    (d / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, '
        '"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, '
        f'"num_hidden_layers": {LAYERS}, "vocab_size": 256, "max_position_embeddings": 1024, '
        '"torch_dtype": "float32", "rms_norm_eps": 1e-5}')
    init_none_hash(sha256)
    return str(d)


def make_config(model, role, engine_id, store_url, policy="recompute", **extra):
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"
    return VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        cache_config=cache, device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="XferConnector", kv_connector_module_path="xfer.engine.vllm_connector", kv_role=role,
            engine_id=engine_id, kv_load_failure_policy=policy,
            kv_connector_extra_config={"store": store_url, "timeout_s": 5.0, "lease_s": 30.0, **extra}))


def kv_cache_config(layout: KVCacheLayout, mla: bool = False) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = (MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16) if mla else
            FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32))
    page = spec.page_size_bytes
    layer_stride, block_stride = (page * BLOCKS, page) if layout.is_layer_compact else (page, page * LAYERS)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_tensors=[
        KVCacheTensor(size=page * BLOCKS * LAYERS, layers=names, layer_stride=layer_stride, block_stride=block_stride)])


class Engine:
    """One vLLM instance's scheduler + worker-side connector over vLLM-allocated KV tensors."""

    def __init__(self, config: VllmConfig, layout=KVCacheLayout.LBNHC, mla=False):
        self.kcc = kv_cache_config(layout, mla)
        config.cache_config.num_gpu_blocks = BLOCKS
        self.sched = Scheduler(vllm_config=config, kv_cache_config=self.kcc, block_size=BS,
                               structured_output_manager=StructuredOutputManager(config), log_stats=True)
        # vLLM 0.33: one [num_blocks, heads, block_size, 2*head_size] view per layer (strides per layout)
        self.kv = allocate_kv_cache(self.kcc, torch.device("cpu"), layout, [BS])
        for t in self.kv.values():
            t.view(torch.uint8).fill_(POISON)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        self.worker.register_kv_caches(self.kv)

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def step(self, forward=None, token=7):
        """One engine step in the model runner's order; ``forward(name, t, block_ids)`` writes KV."""
        out = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        scheduled = list(out.num_scheduled_tokens)
        if scheduled:  # a forward: the attention layers call the connector around themselves
            for name, t in self.kv.items():
                w.wait_for_layer_load(name)
                if forward is not None:
                    for req in out.scheduled_new_reqs:
                        forward(name, t, req.block_ids[0])
                w.save_kv_layer(name, t, None)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                invalid_block_ids=w.get_block_ids_with_load_errors())
        w.clear_connector_metadata()
        tokens = [[token] for _ in scheduled]
        mro = ModelRunnerOutput(req_ids=scheduled, req_id_to_index={r: i for i, r in enumerate(scheduled)},
                                sampled_token_ids=tokens, kv_connector_output=kvo)
        outputs = self.sched.update_from_output(out, mro)
        return out, kvo, [o for eco in outputs.values() for o in eco.outputs]

    def close(self):
        self.worker.shutdown()


def request(rid: str, prompt: list[int], params: dict | None, max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                  block_hasher=get_request_block_hasher(BS, sha256))
    req.kv_transfer_params = params
    return req


def block_bytes(t: torch.Tensor, ids) -> torch.Tensor:
    return t[torch.as_tensor(ids)].contiguous().view(-1).view(torch.uint8)


def random_forward(seed):
    gen = torch.Generator().manual_seed(seed)

    def forward(name, t, block_ids):
        for b in block_ids:  # t[b]: one block of one layer, a strided view of vLLM's buffer
            t[b] = torch.randn(t[b].shape, generator=gen).to(t.dtype)
    return forward


def prefill(p: Engine, prompt, rid="req-1", seed=1, token=7):
    p.sched.add_request(request(rid, prompt, {"do_remote_decode": True}, max_tokens=1))
    out, _, outs = p.step(forward=random_forward(seed), token=token)
    (o,) = [o for o in outs if o.request_id == rid]
    params = o.kv_transfer_params
    assert params and params["do_remote_prefill"] and params["remote_request_id"] == rid, params
    return out.scheduled_new_reqs[0].block_ids[0], params


# ---- a prefill instance in its own process ----------------------------------------------------------
class PrefillProcess:
    """``python tests/vllm_harness.py prefill``: a prefill instance hosting the store (the documented
    set-up); it keeps stepping its engine and prefills on request (one JSON line in, one out)."""

    def __init__(self, model: str, engine_id: str, store_port: int, **extra):
        cmd = [sys.executable, os.path.abspath(__file__), "prefill", model, engine_id, str(store_port),
               json.dumps(extra)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._read(60)["ready"]
        self.pid = self.proc.pid

    def _read(self, limit_s):
        ready, _, _ = select.select([self.proc.stdout], [], [], limit_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"prefill process gave no answer (exit code {self.proc.poll()})")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _prefill_main(model, engine_id, store_port, extra):
    engine = Engine(make_config(model, "kv_producer", engine_id, f"tcp://127.0.0.1:{store_port}",
                                host_store=True, **json.loads(extra)))
    print(json.dumps({"ready": True}), flush=True)
    while True:  # the engine loop: step, and take a command when one is there
        if select.select([sys.stdin], [], [], 0.005)[0]:
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd["op"] == "prefill":
                blocks, params = prefill(engine, list(range(cmd["start"], cmd["start"] + cmd["n"])), cmd["rid"],
                                         seed=cmd.get("seed", 1))
                print(json.dumps({"blocks": blocks, "params": params}), flush=True)
            elif cmd["op"] == "free":
                print(json.dumps({"free": engine.free_blocks()}), flush=True)
        engine.step()
    engine.close()


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        init_none_hash(sha256)
        _prefill_main(*sys.argv[2:])
