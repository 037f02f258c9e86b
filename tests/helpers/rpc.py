"""A gRPC call as its client sees it, for unit tests with no server behind it: a failed call
(Refused: a grpc.RpcError with a status and details) and a unary call's future (Answer: its
reply, or the Refused it ends with). Not a test module: imported as
`from helpers.rpc import Answer, Refused`."""

from __future__ import annotations

import grpc


class Refused(grpc.RpcError):
    """A call that ended with `code` and `details`."""

    def __init__(self, code, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Answer:
    """A unary call's future (`stub.Method.future(...)`): its reply, or the RpcError it ended
    with."""

    def __init__(self, reply=None, error=None):
        self.reply, self.error = reply, error

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.reply
