"""Fakes for the router's reads of a decode worker's Streams call (router/decode_streams.py):
a Stub whose Streams calls the test feeds, and the helpers the tests of those reads share
(tests/unit/test_decode_streams.py, tests/unit/test_router_stepping.py)."""

from __future__ import annotations

import queue
import threading
import time

import grpc

from pdserve.protos.pdserve.v1 import worker_pb2


class FakeCall:
    """A Streams call: the test puts responses (or an error) in; requests are recorded."""

    def __init__(self, requests):
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.sent = []
        threading.Thread(target=self._take, args=(requests,), daemon=True).start()

    def _take(self, requests):
        for request in requests:
            self.sent.append(request)
        self.responses.put(None)  # the router closed its side: the worker ends the call

    def __iter__(self):
        while True:
            item = self.responses.get()
            if item is None:
                return
            if isinstance(item, grpc.RpcError):
                raise item
            yield item


class Stub:
    def __init__(self):
        self.calls = []

    def Streams(self, requests):
        call = FakeCall(requests)
        self.calls.append(call)
        return call


def event(ids, index=0, logprobs=None, tops=None, **kw) -> worker_pb2.TokenEvent:
    e = worker_pb2.TokenEvent(token_ids=ids, index=index, **kw)
    e.logprobs.extend(logprobs or [])
    for t in tops or []:
        e.top_logprobs.add(token_ids=[t])
    return e


def wait_for(cond, what):
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)
