"""xfer: move paged KV-cache blocks between LLM prefill and decode instances."""
