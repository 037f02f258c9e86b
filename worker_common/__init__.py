"""What the prefill and decode workers share: the gRPC server skeleton, pool registration, the
worker process frame, and the one mapping from engine errors to gRPC statuses."""
