"""What the prefill and decode workers share: the gRPC server skeleton, pool registration, the
worker process frame, the one mapping from engine errors to gRPC statuses, and the prefix cache's
KV events on the wire (kv_events.py, with the peer fetch's layout fingerprint)."""
