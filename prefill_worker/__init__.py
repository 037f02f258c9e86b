"""Prefill worker: runs prompts and pushes their KV, layer by layer, into decode reservations."""
