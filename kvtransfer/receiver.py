"""One request's incoming KV on one decode rank: writes chunks, tracks coverage, takes the commit.

Coverage is kept per (layer, token, kv head) of this rank, so chunks may arrive in any order and
split any way (chunked prefill, several prefill TP ranks): a commit is accepted only once every
layer holds every prompt token past the tokens the decode side already had cached. A commit that
comes before then fails the transfer, unless it is marked await_kv (the KV of a pipelined prefill
worker comes over one channel per stage, so another stage's frames may land after the commit):
then it is held, and the chunk that completes the coverage completes the transfer (the
reservation's lease bounds the wait).

A hybrid model's reservation also waits for one "state" frame per recurrent layer (its state
after the prompt, written into the reservation's slot: `states`); the commit needs those too.
With an EAGLE head (`draft`: its cache and layout), "draft" chunks carry the head's KV of the
prompt into the same blocks of the head's cache; the commit does not wait for them
(`draft_complete` says whether they all came).

A chunk that starts before the reservation's cached tokens fails the request before anything is
written: those tokens' blocks come from the decode worker's prefix cache, and other requests may
share them (an honest sender skips them; kvtransfer/backends/claims.py: a claim does not cover
them either).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.reshard import check_chunk, view_bytes, write_chunk
from pdserve.kvtransfer.state import TransferState
from pdserve.kvtransfer.transport import RefusedFrame
from pdserve.kvtransfer.wire import ChunkHeader


class IncompleteTransfer(RuntimeError):
    pass


class KVReceiver:
    def __init__(
        self,
        request_id: str,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        block_ids: list[int],
        num_cached_tokens: int,
        num_prompt_tokens: int,
        states: list | None = None,
        draft: tuple[torch.Tensor, KVLayout] | None = None,
    ):
        self.request_id = request_id
        self.kv_cache = kv_cache
        self.draft = draft
        self._draft_covered = torch.zeros(num_prompt_tokens if draft else 0, dtype=torch.bool)
        self._draft_covered[:num_cached_tokens] = True
        # a hybrid model's reserved slot, each linear layer's whole state over every TP rank's
        # part (LLMEngine.state_views: SlotState), and which layers' state has arrived
        self.states = states
        self._states_in = [False] * len(states or ())
        self.layout = layout
        self.block_ids = block_ids  # the reservation's blocks in this rank's kv_cache
        self.num_cached_tokens = num_cached_tokens  # already held (prefix cache): no KV comes
        self.num_prompt_tokens = num_prompt_tokens
        self.state = TransferState.PENDING
        self.first_tokens: tuple[int, ...] = ()  # every sequence's, in index order (at commit)
        self.first_logprobs: tuple[float, ...] = ()  # theirs, when the request wants logprobs
        self.error: str | None = None
        self.committed = False  # the commit arrived (held while KV is missing: await_kv)
        self.bytes_received = 0
        self._covered = torch.zeros(
            layout.num_layers, num_prompt_tokens, layout.heads_per_rank, dtype=torch.bool
        )
        self._covered[:, :num_cached_tokens] = True

    @property
    def complete(self) -> bool:
        return all(self._states_in) and bool(self._covered.all())

    @property
    def draft_complete(self) -> bool:
        """Every prompt token's head KV arrived (or was cached): EAGLE heads only."""
        return self.draft is not None and bool(self._draft_covered.all())

    def on_frame(self, header: ChunkHeader, payload) -> TransferState:
        if self.state in (TransferState.DONE, TransferState.FAILED):
            return self.state
        try:
            if isinstance(payload, RefusedFrame):  # the server refused a frame of this request
                self._fail(payload.reason)
            elif header.kind == "abort":
                self._fail("the sender aborted the transfer")
            elif header.kind == "commit":
                if self.committed:
                    raise ValueError("a second commit for the same request")
                if not self.complete and not header.await_kv:
                    missing = int((~self._covered).sum())
                    states = self._states_in.count(False)
                    raise IncompleteTransfer(
                        f"commit before all KV arrived ({missing} values missing"
                        + (f", {states} layers' recurrent state" if states else "")
                        + ")"
                    )
                self.first_tokens = header.first_tokens
                self.first_logprobs = header.first_logprobs
                self.committed = True
                self.state = TransferState.DONE if self.complete else TransferState.TRANSFERRING
            else:
                if header.kind == "state":
                    self._write_state(header, payload)
                elif header.kind == "draft":
                    self._write_draft(header, payload)
                else:
                    self._write(header, payload)
                if self.committed and self.complete:  # the commit was waiting for this chunk
                    self.state = TransferState.DONE
        except Exception as e:  # a bad chunk fails this request, never the worker
            self._fail(str(e))
        return self.state

    def _write(self, header: ChunkHeader, payload) -> None:
        # every field is checked before it marks coverage: a layer counts as written only when
        # its bytes are in the blocks (write_chunk checks the payload against the header)
        check_chunk(self.layout, header, self.kv_cache.dtype)
        if not 0 <= header.start < header.end <= self.num_prompt_tokens:
            raise ValueError(
                f"chunk tokens [{header.start}, {header.end}) are not a non-empty range "
                f"of the prompt ({self.num_prompt_tokens} tokens)"
            )
        if header.start < self.num_cached_tokens:
            raise ValueError(
                f"chunk tokens [{header.start}, {header.end}) start before the reservation's "
                f"{self.num_cached_tokens} cached prompt tokens, whose KV blocks this worker's "
                f"prefix cache holds and other requests may share: send only tokens from "
                f"{self.num_cached_tokens} on"
            )
        d0, d1 = self.layout.head_range
        lo, hi = max(d0, header.head_start), min(d1, header.head_end)
        if header.in_place:
            # shm: the sender wrote the KV into kv_cache itself; only record coverage. Only the shm
            # server lets such a frame through (the others refuse it: nothing was written)
            if payload is not None:
                raise ValueError("an in-place KV frame carries no payload")
            written = header.end - header.start if lo < hi else 0
        else:
            written = write_chunk(self.kv_cache, self.layout, self.block_ids, header, payload)
        if written:
            self._covered[header.layer, header.start : header.end, lo - d0 : hi - d0] = True
            if header.in_place:
                self.bytes_received += math.prod(header.shape) * self.kv_cache.element_size()
            else:
                self.bytes_received += (
                    memoryview(payload).nbytes
                    if not isinstance(payload, torch.Tensor)
                    else payload.numel() * payload.element_size()
                )
        self.state = TransferState.TRANSFERRING

    def _write_draft(self, header: ChunkHeader, payload) -> None:
        """An EAGLE head's KV chunk into the same blocks of the head's cache. Ignored by a
        worker without a head, or with another head (another fingerprint: a deployment midway
        through a change of heads), whose guesses then start without the prompt; any other
        field that does not fit fails the request as a "kv" chunk's would."""
        if self.draft is None or header.fingerprint != self.draft[1].fingerprint:
            return
        cache, layout = self.draft
        check_chunk(layout, header, cache.dtype)
        if not self.num_cached_tokens <= header.start < header.end <= self.num_prompt_tokens:
            raise ValueError(
                f"draft chunk tokens [{header.start}, {header.end}) are not within the prompt's "
                f"uncached tokens [{self.num_cached_tokens}, {self.num_prompt_tokens})"
            )
        if header.in_place or payload is None:
            raise ValueError("a draft chunk carries its payload")
        whole = header.head_start == 0 and header.head_end == layout.num_kv_heads
        if write_chunk(cache, layout, self.block_ids, header, payload) and whole:
            self._draft_covered[header.start : header.end] = True
            self.bytes_received += math.prod(header.shape) * cache.element_size()

    def _write_state(self, header: ChunkHeader, payload) -> None:
        """One linear layer's recurrent state into the reserved slot, checked whole first."""
        self.layout.check_compatible(header.fingerprint, "sender")
        if not self.states:
            raise ValueError("a state frame for a model that keeps no recurrent state")
        if not 0 <= header.layer < len(self.states):
            raise ValueError(
                f"state frame layer {header.layer} outside the model's {len(self.states)} "
                f"linear-attention layers"
            )
        if self._states_in[header.layer]:
            raise ValueError(f"a second state frame for linear layer {header.layer}")
        slot = self.states[header.layer]
        need = slot.numel
        if header.dtype != "float32" or payload is None:
            raise ValueError(f"a state frame carries float32 values, got {header.dtype!r}")
        data = payload if isinstance(payload, torch.Tensor) else _float32(payload)
        if data.dtype != torch.float32 or data.numel() != need:
            raise ValueError(
                f"state frame of linear layer {header.layer} has {data.numel()} "
                f"{data.dtype} values; this model's state is {need} float32 values"
            )
        slot.write(data)
        self._states_in[header.layer] = True
        self.bytes_received += need * 4
        self.state = TransferState.TRANSFERRING

    def _fail(self, why: str) -> None:
        self.state, self.error = TransferState.FAILED, why


class WorkerReceiver:
    """One request's incoming KV on a decode worker, all of its TP ranks at once.

    Rank 0 of a tensor-parallel worker holds every rank's pool (mapped from shared files), so one
    receiver per request writes each frame into every rank whose heads it overlaps; the request is
    DONE when every rank is, and FAILED when any is (TransferState.combine).
    """

    def __init__(
        self,
        request_id: str,
        rank_caches: list[torch.Tensor],
        layout: KVLayout,
        block_ids: list[int],
        num_cached_tokens: int,
        num_prompt_tokens: int,
        states: list | None = None,
        draft: tuple[torch.Tensor, KVLayout] | None = None,
    ):
        """states: a hybrid model's reserved slot (LLMEngine.state_views: each layer's state
        written whole, cut for every rank there), which the first rank's receiver takes;
        draft: an EAGLE head's cache and layout (on the first rank)."""
        tp = len(rank_caches)
        self.ranks = [
            KVReceiver(
                request_id,
                cache,
                dataclasses.replace(layout, tp_size=tp, tp_rank=r),
                block_ids,
                num_cached_tokens,
                num_prompt_tokens,
                states if r == 0 else None,
                draft if r == 0 else None,
            )
            for r, cache in enumerate(rank_caches)
        ]

    @property
    def draft_complete(self) -> bool:
        return self.ranks[0].draft_complete

    def on_frame(self, header: ChunkHeader, payload) -> TransferState:
        if header.kind == "state":  # (the first rank's receiver writes every rank's part)
            first, *rest = self.ranks
            return TransferState.combine(
                [first.on_frame(header, payload), *(r.state for r in rest)]
            )
        return TransferState.combine([r.on_frame(header, payload) for r in self.ranks])

    @property
    def first_tokens(self) -> tuple[int, ...]:
        """Every sequence's first token (one for n=1), in index order."""
        return self.ranks[0].first_tokens

    @property
    def first_logprobs(self) -> tuple[float, ...]:
        return self.ranks[0].first_logprobs

    @property
    def error(self) -> str | None:
        return next((r.error for r in self.ranks if r.error), None)

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.ranks)


def _float32(payload) -> torch.Tensor:
    """A bytes-like payload as float32 values (no copy); ValueError when its size is not whole
    values."""
    nbytes = memoryview(payload).nbytes
    if nbytes % 4:
        raise ValueError(f"a state frame's payload of {nbytes} bytes is not float32 values")
    return view_bytes(payload, torch.float32) if nbytes else torch.empty(0)
