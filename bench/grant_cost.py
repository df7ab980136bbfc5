"""What a grant request costs to encode, parse and check: its block ids as JSON lists against packed in
its payload (int64, ``grant_packed``), for 1 and 32 transfers of 128 random ids of a 256-block
region (the medians of five rounds, in us, on this host; no network, no MAC).

    python bench/grant_cost.py
"""
import json, time, os, numpy as np, statistics
from xfer import Agent, AgentConfig, make_kv_cache, shared_empty
from xfer.transports.completion import _fingerprint
from xfer.guard import PACKED_IDS
dims = dict(num_layers=64, num_blocks=256, block_size=1, num_heads=1, head_dim=8)
ts, lay = make_kv_cache("vllm_flash_attn_nhd", empty=shared_empty, **dims)
b = Agent("t", AgentConfig(enable=("local",)))
b.register("kv", ts, lay)
inbox = b._inbox
fp = _fingerprint(lay)
rng = np.random.default_rng(0)
sets = [rng.permutation(256)[:128].astype(np.int64) for _ in range(8)]
def encode(n, k0, packed):
    now = time.monotonic()
    es = []
    for i in range(n):
        e = {"transfer_id": f"t{k0+i}", "op": "write", "region": "kv", "fingerprint": fp, "ttl": 30.0, "sent": now}
        ids = sets[(k0 + i) % 8]
        if packed: e["nblocks"] = len(ids)
        else: e["blocks"] = ids.tolist()
        es.append(e)
    h = {"type": "grant", "from": "i", "pid": os.getpid(), "host": "h", "transfers": es}
    payload = b"".join(np.asarray(sets[(k0 + i) % 8], dtype=PACKED_IDS).tobytes() for i in range(n)) if packed else b""
    return json.dumps(h, separators=(",", ":")).encode(), payload
res = {}
for rep in range(6):
    for packed in (False, True):
        for n in (1, 32):
            t0 = time.perf_counter(); raw, payload = encode(n, rep * 100, packed); t1 = time.perf_counter()
            h = json.loads(raw); t2 = time.perf_counter()
            r = inbox.on_grant(h, payload); t3 = time.perf_counter()
            assert not r["failed"], r
            inbox.on_grant_end({"type": "grant_end", "from": "i", "grants": list(r["grants"].values())})
            res.setdefault((packed, n), []).append((t1 - t0, t2 - t1, t3 - t2, len(raw) + len(payload)))
for (packed, n), v in sorted(res.items()):
    med = [1e6 * statistics.median(x[k] for x in v[1:]) for k in range(3)]
    print(f"{'packed' if packed else 'json  '} n={n:2d} bytes={v[-1][3]:6d} encode {med[0]:5.0f} parse {med[1]:5.0f} on_grant {med[2]:5.0f} total {sum(med):5.0f} us")
b.close()
