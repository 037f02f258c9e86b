"""A failed gRPC call as its client sees it, for unit tests that need a grpc.RpcError with a
status and details and no server behind it. Not a test module: imported as
`from helpers.rpc import Refused`."""

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
