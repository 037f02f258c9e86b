"""The tiny cluster's processes as the tests start them: a decode worker, a prefill worker and a
Router in front, with the settings most tests share (1 MiB of KV each; blocks of 16 on the decode
worker, 4 on the prefill worker, so a hand-off re-blocks)."""

from __future__ import annotations

from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.router.server import Router, RouterConfig

DECODE_ENGINE = dict(kv_cache_memory=1 << 20, block_size=16)
PREFILL_ENGINE = dict(kv_cache_memory=1 << 20, block_size=4)


def start_decode(model_dir, worker_id: str = "d0", engine: dict | None = None, **config):
    """A started DecodeWorker; engine: its engine_kwargs over DECODE_ENGINE; config: more
    DecodeWorkerConfig fields."""
    return _start(
        DecodeWorker, DecodeWorkerConfig, DECODE_ENGINE, model_dir, worker_id, engine, config
    )


def start_prefill(model_dir, worker_id: str = "p0", engine: dict | None = None, **config):
    """A started PrefillWorker; engine: its engine_kwargs over PREFILL_ENGINE."""
    return _start(
        PrefillWorker, PrefillWorkerConfig, PREFILL_ENGINE, model_dir, worker_id, engine, config
    )


def _start(worker, worker_config, base_engine, model_dir, worker_id, engine, config):
    engine_kwargs = {**base_engine, **(engine or {})}
    return worker(
        worker_config(model=model_dir, worker_id=worker_id, engine_kwargs=engine_kwargs, **config)
    ).start()


def start_router(model_dir, decode, prefill=None, **config) -> Router:
    """A started Router in front of the worker(s) `decode` (one or a list) and `prefill` (None:
    no prefill pool, as colocated=True wants)."""
    decodes = decode if isinstance(decode, list) else [decode]
    return Router(
        RouterConfig(
            model=model_dir,
            prefill_addresses=() if prefill is None else (prefill.address,),
            decode_addresses=tuple(w.address for w in decodes),
            **config,
        )
    ).start()


def stop_all(channels, *processes) -> None:
    """Closes the channels, then stops the processes in the order given (router first)."""
    for ch in channels:
        ch.close()
    for p in processes:
        p.stop()


def record_aborts(decode, monkeypatch) -> list:
    """The (request id, reason) of each abort of `decode`'s hand-off from now on, as they come."""
    aborted = []
    real_abort = decode.handoff.abort
    monkeypatch.setattr(
        decode.handoff,
        "abort",
        lambda rid, reason="": aborted.append((rid, reason)) or real_abort(rid, reason),
    )
    return aborted
