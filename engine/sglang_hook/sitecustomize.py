"""Put on PYTHONPATH by ``python -m xfer.engine.sglang_plugin``: every Python process started from it
(SGLang's spawned scheduler ranks included) swaps SGLang's ``XFER_SGLANG_REPLACE`` transfer backend
for xfer as soon as SGLang's disaggregation utils load. Does nothing when the variable is unset."""

import os

if os.environ.get("XFER_SGLANG_REPLACE"):
    try:
        from xfer.engine.sglang_plugin import install_import_hook
        install_import_hook(os.environ["XFER_SGLANG_REPLACE"])
    except ImportError as exc:  # SGLang or xfer missing in this interpreter: leave it untouched
        import sys
        print(f"xfer sglang hook not installed: {exc}", file=sys.stderr)
