"""The standard gRPC health service (grpc.health.v1.Health) of a worker's server
(worker_common/grpc_server.py ServiceHost), in place of grpcio's HealthServicer.

grpcio's servicer sends a Watch's responses while it holds its lock, and each send waits for
gRPC's completion-queue thread to complete it; that thread, closing another Watch at the same
moment, runs the servicer's close callback, which waits for the same lock. Each waits for the
other, and the server serves nothing more: a worker stopped while a Watch ended hung in
`enter_graceful_shutdown` (seen in CI, its stop never returned). Here the lock only guards the
statuses and the watchers, and responses are sent outside it, in order under a second lock that
no gRPC thread takes: each send reads the service's status as it is then, so a watcher's last
response is the latest status.

Lifecycle: made with its ServiceHost, `set` once the server started (SERVING), and
`enter_graceful_shutdown` when it stops (NOT_SERVING, after which `set` changes nothing). Watch
is non-blocking (it holds no handler thread while it waits for changes); a server without
non-blocking support gets a generator of the responses instead.
"""

from __future__ import annotations

import queue
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_Status = health_pb2.HealthCheckResponse
_END = object()  # a blocking Watch's stream ends


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self):
        self._lock = threading.Lock()  # statuses and watchers; never held while sending
        self._sending = threading.Lock()  # the order of sends; no gRPC thread takes it
        self._status: dict[str, int] = {"": _Status.SERVING}
        self._watchers: dict[str, set] = {}
        self._closing = False

    def Check(self, request, context):
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return _Status()
        return _Status(status=status)

    def Watch(self, request, context, send_response_callback=None):
        """Sends the service's status now and at each change, until the call ends."""
        send, stream = send_response_callback, None
        if send is None:  # a server without non-blocking calls: a generator of the responses
            stream = queue.SimpleQueue()
            send = lambda response: stream.put(_END if response is None else response)  # noqa: E731
        service = request.service
        with self._sending:
            with self._lock:
                self._watchers.setdefault(service, set()).add(send)
                status = self._status.get(service, _Status.SERVICE_UNKNOWN)
            forget = self._forget(service, send)
            if not context.add_callback(forget):  # the call already ended
                forget()
                return None
            send(_Status(status=status))
        return None if stream is None else _responses(stream)

    Watch.experimental_non_blocking = True
    Watch.experimental_thread_pool = None

    def _forget(self, service: str, send):
        def forget() -> None:  # on gRPC's thread: takes only the short lock
            with self._lock:
                self._watchers.get(service, set()).discard(send)
            send(None)  # the end of the watcher's stream

        return forget

    def set(self, service: str, status: int) -> None:
        """Sets `service`'s status and tells its watchers (a no-op once shutting down)."""
        with self._lock:
            if self._closing:
                return
            self._status[service] = status
        self._tell(service)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            for service in self._status:
                self._status[service] = _Status.NOT_SERVING
            services = list(self._status)
        for service in services:
            self._tell(service)

    def _tell(self, service: str) -> None:
        with self._sending:
            with self._lock:
                status = self._status.get(service, _Status.SERVICE_UNKNOWN)
                watchers = list(self._watchers.get(service, ()))
            for send in watchers:
                send(_Status(status=status))


def _responses(stream: queue.SimpleQueue):
    while (response := stream.get()) is not _END:
        yield response
