"""HTTP/2 keepalive between pdserve's own processes: the options every internal gRPC channel sets
(the router's channels to workers, a worker's registration channel to the router, a prefill
worker's KV channels to decode workers) and the options every pdserve gRPC server sets to accept
those pings.

A peer that stops answering (a stopped or hung process, a half-open connection after a host or
network failure) keeps its socket open, so no call on it fails by itself: it just waits. With
keepalive, a ping unanswered for KEEPALIVE_TIMEOUT_MS fails every call open on the channel
UNAVAILABLE, so the caller's own recovery runs (a resume, a retry, a re-registration) within
about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS. A server by default answers pings more often than
every 5 minutes with GOAWAY "too_many_pings"; SERVER_OPTIONS lets clients ping every
MIN_PING_INTERVAL_MS, idle channels included, and never counts an early ping (timer jitter)
against a client.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 5_000  # servers accept pings this often; clients ping every 10 s

CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # newer gRPC cores time pings by this
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data for a while
]

SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
]
