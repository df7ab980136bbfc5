"""engine/examples/pd_proxy.py against stand-ins of vLLM's OpenAI server (loopback): the two calls
of a request, kv_transfer_params forwarded verbatim, round robin over xPyD, a dead prefill."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.timeout(60)

_spec = importlib.util.spec_from_file_location(
    "pd_proxy", os.path.join(os.path.dirname(__file__), "..", "engine", "examples", "pd_proxy.py"))
pd_proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pd_proxy)
_OPEN = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Instance:
    """A stand-in vLLM instance: records request bodies; a prefill returns kv_transfer_params."""

    def __init__(self, name: str, prefill: bool):
        self.name, self.bodies = name, []
        me = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                me.bodies.append(body)
                out = {"id": me.name, "choices": [{"text": f"from {me.name}"}]}
                if prefill:
                    out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": me.name,
                                                 "remote_block_ids": [3, 1], "lease_expires": 1e12}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def deployment():
    p = [Instance("p0", True), Instance("p1", True)]
    d = [Instance("d0", False), Instance("d1", False)]
    proxy = pd_proxy.serve("127.0.0.1", 0, pd_proxy.Proxy([i.url for i in p], [i.url for i in d], 10))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}", p, d
    proxy.shutdown()
    proxy.server_close()
    for i in p + d:
        i.close()


def ask(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with _OPEN.open(req, timeout=10) as r:
        return json.loads(r.read())


def test_two_calls_per_request_round_robin(deployment):
    url, p, d = deployment
    for i in range(4):
        out = ask(url, {"model": "m", "prompt": f"hi {i}", "max_tokens": 20, "stream": False})
        assert out["id"] == f"d{i % 2}"
    for inst in p:  # each prefill got two requests, shortened to one token, asking to hand off
        assert len(inst.bodies) == 2
        assert all(b["max_tokens"] == 1 and b["kv_transfer_params"] == {"do_remote_decode": True} for b in inst.bodies)
    for k, inst in enumerate(d):  # each decode got the original request and the prefill's params verbatim
        assert [b["prompt"] for b in inst.bodies] == [f"hi {k}", f"hi {k + 2}"]
        for b in inst.bodies:
            assert b["max_tokens"] == 20
            assert b["kv_transfer_params"]["remote_block_ids"] == [3, 1]
            assert b["kv_transfer_params"]["remote_engine_id"] in ("p0", "p1")


def test_dead_prefill_leaves_the_prompt_to_the_decode(deployment):
    url, p, d = deployment
    p[0].close()
    out = ask(url, {"model": "m", "prompt": "x", "max_tokens": 5})
    assert out["id"] == "d0" and "kv_transfer_params" not in d[0].bodies[-1]
