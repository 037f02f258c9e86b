"""The open channels of one gRPC KV server, with limits a peer holding idle channels cannot turn
into a denial of service.

Each open Push stream holds a server thread, so the server admits at most max_channels of them:
  - a peer (a network address, from the stream's context) holds at most max_channels_per_peer;
  - when a limit is reached, the new stream takes the slot of the longest-idle stream (of that
    peer, or of anyone for the total) if it has been idle at least min_idle_evict_s; a stream
    that is receiving or handling frames is never evicted; with no such stream the new one is
    refused with RESOURCE_EXHAUSTED;
  - a stream with no frame for idle_timeout_s is closed.
Closing a stream cancels it (the sender sees CANCELLED; GrpcTransport reopens one at its next
send when every frame it sent was confirmed). Cancelling is a call into gRPC core that does not
wait: admission runs on the new stream's own thread, the idle sweep on its own thread, and
neither ever blocks a gRPC poller thread.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

log = logging.getLogger(__name__)


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def peer_host(peer: str) -> str:
    """The network address of a gRPC peer string, without its port ("ipv4:10.0.0.5:41234" ->
    "ipv4:10.0.0.5"): what a sender cannot change by opening another connection."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class Channel:
    __slots__ = ("id", "peer", "context", "last_active", "pending", "handled", "closed")

    def __init__(self, channel_id: str, peer: str, context):
        self.id, self.peer, self.context = channel_id, peer, context
        self.last_active = time.monotonic()
        self.pending = 0  # frames received and not yet handled: the channel is busy
        self.handled = 0
        self.closed = False  # evicted or timed out: the stream is being cancelled


class ChannelTable:
    def __init__(
        self,
        max_channels: int,
        max_channels_per_peer: int,
        idle_timeout_s: float,
        min_idle_evict_s: float,
    ):
        for name, value in (
            ("max_channels", max_channels),
            ("max_channels_per_peer", max_channels_per_peer),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not idle_timeout_s > 0 or not min_idle_evict_s >= 0:
            raise ValueError(
                f"idle_timeout_s must be > 0 and min_idle_evict_s >= 0, got "
                f"{idle_timeout_s} and {min_idle_evict_s}"
            )
        self.max_channels, self.max_per_peer = max_channels, max_channels_per_peer
        self.idle_timeout_s, self.min_idle_evict_s = idle_timeout_s, min_idle_evict_s
        self.cond = threading.Condition()
        self._open: dict[str, Channel] = {}
        self.num_evicted = self.num_idle_closed = 0
        self._stopped = False
        self._stop_sweeping = threading.Event()  # (not `cond`: every handled frame notifies that)
        self._sweeper = threading.Thread(
            target=self._sweep, name="pdserve-kv-grpc-idle", daemon=True
        )
        self._sweeper.start()

    def admit(self, channel_id: str, peer: str, context) -> Channel:
        """Registers a new stream, evicting an idle one if a limit is reached; raises Refused."""
        victims = []
        with self.cond:
            if channel_id in self._open:
                raise Refused(
                    grpc.StatusCode.ALREADY_EXISTS, f"KV channel {channel_id} is already open"
                )
            mine = [c for c in self._open.values() if c.peer == peer]
            if len(mine) >= self.max_per_peer:
                victims.append(
                    self._evictable(
                        mine,
                        Refused(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{peer} holds {len(mine)} KV channels to this server (max_channels_per_peer="
                            f"{self.max_per_peer}), all busy within the last {self.min_idle_evict_s}s: reuse "
                            f"one channel per decode worker, or raise max_channels_per_peer",
                        ),
                    )
                )
            elif len(self._open) >= self.max_channels:
                victims.append(
                    self._evictable(
                        list(self._open.values()),
                        Refused(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"this KV transfer server holds {len(self._open)} channels (max_channels="
                            f"{self.max_channels}), all busy within the last {self.min_idle_evict_s}s: retry "
                            f"later, or raise max_channels",
                        ),
                    )
                )
            channel = self._open[channel_id] = Channel(channel_id, peer, context)
            self.num_evicted += len(victims)
            self.cond.notify_all()
        self._cancel(victims, "evicted for a new channel")
        return channel

    def _evictable(self, channels: list[Channel], refused: Refused) -> Channel:
        """The longest-idle of `channels` that may be evicted (taken out of the table), else raise."""
        now = time.monotonic()
        idle = [
            c for c in channels if c.pending == 0 and now - c.last_active >= self.min_idle_evict_s
        ]
        if not idle:
            raise refused
        victim = min(idle, key=lambda c: c.last_active)
        self._take(victim)
        return victim

    def _take(self, channel: Channel) -> None:
        channel.closed = True
        if self._open.get(channel.id) is channel:
            del self._open[channel.id]

    @staticmethod
    def _cancel(channels: list[Channel], why: str) -> None:
        for channel in channels:
            log.info("closing KV channel %s from %s: %s", channel.id[:8], channel.peer, why)
            channel.context.cancel()  # the stream's thread sees its request iterator end

    def release(self, channel: Channel) -> None:
        with self.cond:
            self._take(channel)
            self.cond.notify_all()

    def received(self, channel: Channel, frames: int) -> None:
        with self.cond:
            channel.pending += frames
            channel.last_active = time.monotonic()

    def done(self, channel: Channel, counted: bool = True) -> None:
        """One received frame left the handler (counted: it counts as handled for Flush)."""
        with self.cond:
            channel.pending -= 1
            channel.handled += counted
            channel.last_active = time.monotonic()
            self.cond.notify_all()

    def wait_handled(self, channel_id: str, frames: int, wait_s: float) -> int:
        """Frames handled on an open channel (-1: none open with that id), after waiting up to
        wait_s for `frames` of them."""

        def handled() -> int:
            channel = self._open.get(channel_id)
            return -1 if channel is None else channel.handled

        with self.cond:
            self.cond.wait_for(lambda: self._stopped or handled() >= frames, timeout=wait_s)
            return handled()

    def _sweep(self) -> None:
        period = min(1.0, max(0.05, self.idle_timeout_s / 4))
        while not self._stop_sweeping.wait(period):
            with self.cond:
                now = time.monotonic()
                stale = [
                    c
                    for c in self._open.values()
                    if c.pending == 0 and now - c.last_active >= self.idle_timeout_s
                ]
                for channel in stale:
                    self._take(channel)
                self.num_idle_closed += len(stale)
            self._cancel(stale, f"no frame for {self.idle_timeout_s}s (idle_timeout_s)")

    @property
    def num_open(self) -> int:
        return len(self._open)

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify_all()
        self._stop_sweeping.set()
        self._sweeper.join()
