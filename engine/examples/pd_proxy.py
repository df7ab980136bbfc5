"""A minimal prefill/decode proxy for vLLM instances running XferConnector (standard library only).

    python engine/examples/pd_proxy.py --port 8000 \\
        --prefill http://10.0.0.1:8100 [--prefill http://10.0.0.1:8101 ...] \\
        --decode http://10.0.0.2:8200 [--decode http://10.0.0.2:8201 ...]

For each ``POST /v1/completions`` or ``/v1/chat/completions`` it picks a prefill and a decode
instance (round robin; 1P1D is one of each, xPyD several), sends the request to the prefill with
``max_tokens=1``, no streaming and ``kv_transfer_params={"do_remote_decode": true}``, then sends
the original request to the decode instance with the ``kv_transfer_params`` the prefill returned,
verbatim, and streams the decode's answer back. ``GET /v1/models`` goes to the first decode. A
prefill that fails or returns no ``kv_transfer_params`` gets the request computed by the decode
instance alone. Not a production router: no health checks, retries or load awareness.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # instances are reached directly


def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    return _NO_PROXY.open(req, timeout=timeout)


class Proxy:
    """Round-robin choice of instances and the two calls of one request."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0):
        if not prefill or not decode:
            raise ValueError(f"need at least one prefill and one decode URL, got {prefill!r} and {decode!r}")
        self.prefill, self.decode, self.timeout_s = prefill, decode, timeout_s
        self._p, self._d = itertools.cycle(prefill), itertools.cycle(decode)

    def prefill_params(self, path: str, body: dict) -> dict | None:
        """Run the prefill; the kv_transfer_params it returns (None: the decode computes alone)."""
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        url = next(self._p) + path
        try:
            with _post(url, first, self.timeout_s) as r:
                return json.loads(r.read()).get("kv_transfer_params")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            print(f"pd_proxy: prefill {url} failed ({exc}); the decode instance computes the prompt",
                  file=sys.stderr)
            return None

    def decode_request(self, path: str, body: dict, params: dict | None):
        second = dict(body)
        if params:
            second["kv_transfer_params"] = params
        return _post(next(self._d) + path, second, self.timeout_s)


def make_handler(proxy: Proxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self, upstream) -> None:
            self.send_response(upstream.status)
            for k in ("content-type",):
                if upstream.headers.get(k):
                    self.send_header(k, upstream.headers[k])
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            while chunk := upstream.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _error(self, code: int, message: str) -> None:
            data = json.dumps({"error": {"message": message}}).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server's name
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._error(404, f"no route {self.path}")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            except ValueError:
                return self._error(400, "the body is not JSON")
            params = proxy.prefill_params(self.path, body)
            try:
                with proxy.decode_request(self.path, body, params) as upstream:
                    self._relay(upstream)
            except urllib.error.HTTPError as exc:
                self._relay(exc)
            except (urllib.error.URLError, OSError) as exc:
                self._error(502, f"decode instance failed: {exc}")

        def do_GET(self):  # noqa: N802
            try:
                with _NO_PROXY.open(proxy.decode[0] + self.path, timeout=proxy.timeout_s) as upstream:
                    self._relay(upstream)
            except urllib.error.HTTPError as exc:
                self._relay(exc)
            except (urllib.error.URLError, OSError) as exc:
                self._error(502, f"decode instance failed: {exc}")

        def log_message(self, fmt, *args):  # one line per request on stderr
            sys.stderr.write("pd_proxy: " + fmt % args + "\n")
    return Handler


def serve(host: str, port: int, proxy: Proxy) -> ThreadingHTTPServer:
    return ThreadingHTTPServer((host, port), make_handler(proxy))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL (repeat)")
    ap.add_argument("--decode", action="append", required=True, help="a decode instance's base URL (repeat)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per upstream call")
    a = ap.parse_args(argv)
    server = serve(a.host, a.port, Proxy(a.prefill, a.decode, a.timeout_s))
    print(f"pd_proxy: http://{a.host}:{a.port} -> prefill {a.prefill}, decode {a.decode}", file=sys.stderr)
    server.serve_forever()


if __name__ == "__main__":
    main()
