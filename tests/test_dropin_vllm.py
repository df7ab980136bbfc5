"""XferConnector inside real vLLM (opt-in: needs vLLM installed, see README.md, "Running the engine tests").

vLLM's own v1 ``Scheduler`` (on CPU) drives the connector's scheduler side for a prefill -> decode
request; the worker side is driven in vLLM's call order (``_get_kv_connector_output``) on the KV
tensors vLLM's own ``allocate_kv_cache`` lays out, and the decode blocks are checked byte for byte.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is a local config.json: never ask the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (opt-in engine tests: see the README section Running the engine tests)")

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
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from xfer.store import open_store  # noqa: E402

pytestmark = pytest.mark.timeout(300)

BS, LAYERS, BLOCKS, HEADS, HEAD = 4, 2, 24, 2, 8
EOS = 255
POISON = 0x5A


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, '
        '"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, '
        f'"num_hidden_layers": {LAYERS}, "vocab_size": 256, "max_position_embeddings": 1024, '
        '"torch_dtype": "float32", "rms_norm_eps": 1e-5}')
    init_none_hash(sha256)
    return str(d)


@pytest.fixture
def store():
    s = open_store("tcp://127.0.0.1:0")
    yield s
    s.close()


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
        self.kv = allocate_kv_cache(self.kcc, torch.device("cpu"), layout, [BS])
        for t in self.kv.values():
            t.view(torch.uint8).fill_(POISON)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        self.worker.register_kv_caches(self.kv)

    def step(self, forward=None, token=7):
        """One engine step in the model runner's order; ``forward(req_id, block_ids)`` writes KV."""
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
        mro = ModelRunnerOutput(req_ids=scheduled, req_id_to_index={r: i for i, r in enumerate(scheduled)},
                                sampled_token_ids=[[token] for _ in scheduled], kv_connector_output=kvo)
        outputs = self.sched.update_from_output(out, mro)
        return out, kvo, [o for eco in outputs.values() for o in eco.outputs]

    def close(self):
        self.worker.shutdown()


def request(rid: str, prompt: list[int], params: dict, max_tokens: int) -> Request:
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


def prefill(p: Engine, prompt, rid="req-1", seed=1):
    p.sched.add_request(request(rid, prompt, {"do_remote_decode": True}, max_tokens=1))
    out, _, outs = p.step(forward=random_forward(seed))
    (o,) = [o for o in outs if o.request_id == rid]
    params = o.kv_transfer_params
    assert params and params["do_remote_prefill"] and params["remote_request_id"] == rid
    return out.scheduled_new_reqs[0].block_ids[0], params


def run_decode(d: Engine, prompt, params, rid="dreq-1", limit_s=20.0):
    d.sched.add_request(request(rid, prompt, dict(params), max_tokens=3))
    seen_invalid, loaded = set(), None
    end = time.monotonic() + limit_s
    while time.monotonic() < end:  # the engine loop: steps until the load landed and the request runs
        out, kvo, _ = d.step()
        seen_invalid |= kvo.invalid_block_ids
        for r in out.scheduled_new_reqs:
            if r.req_id == rid:
                loaded = r
        if loaded is not None:
            return loaded, seen_invalid
    raise AssertionError(f"decode request {rid} was never scheduled after its load")


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
@pytest.mark.parametrize("load_async", [True, False])
def test_prefill_to_decode_with_vllm_scheduler(tiny_model, store, layout, load_async):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-a", store.endpoint), layout)
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-a", store.endpoint, load_async=load_async), layout)
    try:
        prompt = list(range(1, 19))  # 18 tokens: 5 blocks of 4, the last partial
        p_blocks, params = prefill(p, prompt)
        assert params["remote_block_ids"] == p_blocks
        loaded, invalid = run_decode(d, prompt, params)
        assert not invalid
        d_blocks = d.sched.kv_cache_manager.get_block_ids("dreq-1")[0][:len(p_blocks)]
        # async: vLLM recomputes only the last prompt token; sync: the forward computes it
        assert loaded.num_computed_tokens == len(prompt) - 1
        for name in p.kv:
            assert torch.equal(block_bytes(p.kv[name], p_blocks), block_bytes(d.kv[name], d_blocks)), name
            rest = sorted(set(range(BLOCKS)) - set(d_blocks))
            assert (block_bytes(d.kv[name], rest) == POISON).all(), f"{name}: a block outside the load changed"
        # the decode side released the prefill blocks: the prefill scheduler frees them
        free_before = p.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            _, kvo, _ = p.step()
            if kvo.finished_sending:
                assert kvo.finished_sending == {"req-1"}
                break
            time.sleep(0.01)
        else:
            raise AssertionError("prefill never reported finished_sending")
        assert p.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + len(p_blocks)
        assert "req-1" not in p.sched.requests
    finally:
        p.close()
        d.close()


def test_mla_layout(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-m", store.endpoint, use_mla=True, total_kv_heads=1),
               mla=True)
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-m", store.endpoint, use_mla=True, total_kv_heads=1),
               mla=True)
    try:
        assert p.worker._worker.link.layouts[0].name == "mla"
        prompt = list(range(3, 13))
        p_blocks, params = prefill(p, prompt, seed=3)
        run_decode(d, prompt, params)
        d_blocks = d.sched.kv_cache_manager.get_block_ids("dreq-1")[0][:len(p_blocks)]
        for name in p.kv:
            assert torch.equal(block_bytes(p.kv[name], p_blocks), block_bytes(d.kv[name], d_blocks))
    finally:
        p.close()
        d.close()


def test_failed_load_reports_blocks_and_vllm_recomputes(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-f", store.endpoint))
    d = Engine(make_config(tiny_model, "kv_consumer", "decode-f", store.endpoint, policy="recompute"))
    try:
        prompt = list(range(5, 17))
        _, params = prefill(p, prompt, seed=5)
        p.close()  # the prefill instance dies before the decode side reads
        loaded, invalid = run_decode(d, prompt, params)
        d_blocks = d.sched.kv_cache_manager.get_block_ids("dreq-1")[0]
        assert invalid and invalid <= set(d_blocks)
        assert loaded.num_computed_tokens == 0  # vLLM recomputes the prompt (kv_load_failure_policy=recompute)
    finally:
        p.close()
        d.close()


def test_lease_frees_unread_prefill_blocks(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-l", store.endpoint, lease_s=6.0, timeout_s=5.0))
    try:
        free0 = p.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        p_blocks, _ = prefill(p, list(range(2, 14)))
        assert p.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0 - len(p_blocks)
        end = time.monotonic() + 15
        while time.monotonic() < end:  # nobody reads: the lease ends and the blocks free
            _, kvo, _ = p.step()
            if kvo.finished_sending:
                break
            time.sleep(0.2)
        assert kvo.finished_sending == {"req-1"}
        assert p.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    finally:
        p.close()


def test_aborted_prefill_holds_nothing(tiny_model, store):
    p = Engine(make_config(tiny_model, "kv_producer", "prefill-x", store.endpoint))
    try:
        p.sched.add_request(request("r", list(range(1, 9)), {"do_remote_decode": True}, max_tokens=1))
        p.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        _, _, outs = p.step()
        assert all(o.kv_transfer_params is None for o in outs)
        assert "r" not in p.sched.requests
    finally:
        p.close()
