"""The torch backend's handshake: a sender proves it holds the cluster secret before the server
builds a gloo group for it.

Keys of connection N live under "pdserve/kv/connN/":
  1. the sender takes N from the store's connection counter;
  2. the server (its accept loop) publishes `nonce` (32 random bytes, kept in memory too);
  3. the sender writes `auth` = HMAC-SHA256(secret, nonce || str(N));
  4. the server compares it with its own (hmac.compare_digest against the nonce it remembers, so
     a rewritten `nonce` key only breaks that handshake) and writes `verdict`: b"ok", or
     b"refused: ..."; only then does it build the group (under "pdserve/kv/connN/group/").
The accept loop never waits on a sender: each poll checks the pending handshakes without
blocking; one still silent after auth_timeout is refused, and at most max_pending handshakes are
kept (the newest; a flood of counter increments cannot grow them or stall the loop).

A server without a secret (INSECURE) runs the same steps and accepts any `auth`.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import hmac
import logging
import os
import time

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve/kv"
CONNECTIONS_KEY = f"{KEY_PREFIX}/connections"
NONCE_BYTES = 32
OK = b"ok"


def conn_prefix(conn_id: int) -> str:
    return f"{KEY_PREFIX}/conn{conn_id}/"


def group_prefix(conn_id: int) -> str:
    """Where the connection's gloo group meets (after the handshake)."""
    return f"{conn_prefix(conn_id)}group/"


def _key(conn_id: int, name: str) -> str:
    return conn_prefix(conn_id) + name


def mac(secret: str | None, nonce: bytes, conn_id: int) -> bytes:
    return hmac.new((secret or "").encode(), nonce + str(conn_id).encode(), hashlib.sha256).digest()


def authenticate(store, conn_id: int, secret: str | None, timeout: float) -> None:
    """Sender side, after taking conn_id: answer the server's nonce and wait for its verdict.
    ConnectionRefusedError: the server refused this sender; RuntimeError from the store: no answer
    within timeout."""
    wait = datetime.timedelta(seconds=timeout)
    store.wait([_key(conn_id, "nonce")], wait)
    nonce = store.get(_key(conn_id, "nonce"))
    store.set(_key(conn_id, "auth"), mac(secret, nonce, conn_id))
    store.wait([_key(conn_id, "verdict")], wait)
    verdict = store.get(_key(conn_id, "verdict"))
    if verdict != OK:
        raise ConnectionRefusedError(
            f"the KV transfer server refused this sender ({verdict[:80].decode(errors='replace')}): "
            f"both workers need the deployment's cluster secret"
        )


class Gatekeeper:
    """Server side: run `poll()` from the accept loop; it returns the connection ids that passed."""

    def __init__(self, store, secret: str | None, auth_timeout: float, max_pending: int):
        self._store, self._secret = store, secret
        self._auth_timeout, self._max_pending = auth_timeout, max(1, max_pending)
        self._pending: collections.OrderedDict[int, tuple[bytes, float]] = collections.OrderedDict()
        self._seen = 0
        self.num_refused = 0

    def poll(self) -> list[int]:
        store = self._store
        announced = store.add(CONNECTIONS_KEY, 0)
        if announced - self._seen > self._max_pending:  # a flood: only the newest can be served
            log.warning(
                "KV transfer store: %d connections announced at once; skipping all but the "
                "newest %d",
                announced - self._seen,
                self._max_pending,
            )
            self._seen = announced - self._max_pending
        while self._seen < announced:
            conn_id, nonce = self._seen, os.urandom(NONCE_BYTES)
            store.delete_key(_key(conn_id, "auth"))  # an answer written before the nonce is void
            store.set(_key(conn_id, "nonce"), nonce)
            self._pending[conn_id] = (nonce, time.monotonic() + self._auth_timeout)
            if len(self._pending) > self._max_pending:
                self._refuse(next(iter(self._pending)), "too many handshakes pending")
            self._seen += 1
        passed, now = [], time.monotonic()
        for conn_id, (nonce, deadline) in list(self._pending.items()):
            if store.check([_key(conn_id, "auth")]):
                presented = store.get(_key(conn_id, "auth"))
                if self._secret and not hmac.compare_digest(
                    presented, mac(self._secret, nonce, conn_id)
                ):
                    self._refuse(conn_id, "wrong credentials")
                    continue
                del self._pending[conn_id]
                store.set(_key(conn_id, "verdict"), OK)
                passed.append(conn_id)
            elif now > deadline:
                self._refuse(conn_id, f"no answer within auth_timeout={self._auth_timeout}s")
        return passed

    def _refuse(self, conn_id: int, why: str) -> None:
        del self._pending[conn_id]
        self.num_refused += 1
        log.warning("refused KV sender %d: %s", conn_id, why)
        self._store.set(_key(conn_id, "verdict"), f"refused: {why}".encode())
