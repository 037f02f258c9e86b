"""The per-worker Prometheus families (router/metrics.py registers them on the router's registry):
gauges of each worker's load and KV cache, its role state, and its counters (prefix cache,
preemptions, KV hand-offs, expired leases, speculative decoding), all read at scrape time by
WorkerCollector from the last WorkerStats the router's WorkerPool keeps, so a scrape never makes
an RPC. Names follow vLLM's where vLLM has the figure (vllm/v1/metrics/loggers.py,
vllm/v1/spec_decode/metrics.py), with labels model_name, role and worker on every series. A
worker's counters restart at 0 with its process, which rate() and increase() allow.

The host-memory tier below a worker's KV cache (engine/kv_host_tier.py): its bytes and cap as
gauges, the blocks copied into it, restored from it and pushed out of it as counters, and the
prefix-hit tokens by source ("device": found in the KV cache; "host": restored from the tier);
the host ones also as vLLM's vllm:external_prefix_cache_hits (its name for hits served from
below the KV cache, an offloading connector's). The tier's disk level (engine/kv_disk_tier.py):
its files' bytes and cap as gauges, blocks written, restored, pushed out, dropped (its writer's
queue full), refused (a file that failed a check) and whose write failed as counters, and its
hits as source "disk" (not in the external hits, which stay the host memory's).

vllm:cache_config_info: 1, with the worker's block size and KV blocks as labels, as vLLM's
engine reports its cache config (tools read the cache's size from it). vllm:engine_sleep_state:
1 for the worker's sleep state (router/sleep.py), vLLM's names: awake, weights_offloaded (level
1; a CPU engine's weights stay where they are) and discard_all (level 2), 0 for the others.

LoRA adapters (engine/lora.py): how many a worker serves and how many are resident as gauges,
the adapters read from disk into its resident set and evicted from it as counters; and, for a
worker with LoRA on, vLLM's vllm:lora_requests_info, whose labels name the adapters of the
sequences running and waiting there (comma-separated) and max_lora, and whose value is a time
(unix seconds, the scrape's: the Stats behind it are at most a poll old), the shape the Gateway
API inference extension's endpoint picker reads for LoRA affinity.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's, for levels 0, 1 and 2
# (name, documentation, WorkerStats field) of the per-worker counters, each exposed as NAME_total
WORKER_COUNTERS = (
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in prompt tokens looked up.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in prompt tokens found.",
        "prefix_cache_hits",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "Prefix cache hits served from below the KV cache (the host tier), in prompt tokens.",
        "prefix_hit_tokens_host",
    ),
    (
        "pdserve:kv_host_tier_stored_blocks",
        "KV blocks copied into the host tier as the KV cache evicted them.",
        "kv_host_tier_stored",
    ),
    (
        "pdserve:kv_host_tier_restored_blocks",
        "KV blocks copied back from the host tier into the KV cache for a prompt.",
        "kv_host_tier_restored",
    ),
    (
        "pdserve:kv_host_tier_evicted_blocks",
        "KV blocks pushed out of the host tier to keep it within its cap.",
        "kv_host_tier_evicted",
    ),
    (
        "pdserve:kv_host_tier_refused_blocks",
        "KV blocks asked back from the host tier (either level) and refused: a chain, layout "
        "or CRC that did not match; dropped and recomputed.",
        "kv_host_tier_refused",
    ),
    (
        "pdserve:kv_host_tier_stored_states",
        "A hybrid model's recurrent states copied into the host tier as they left their slots.",
        "kv_host_tier_states_stored",
    ),
    (
        "pdserve:kv_host_tier_restored_states",
        "A hybrid model's recurrent states copied back from the host tier for a prompt.",
        "kv_host_tier_states_restored",
    ),
    (
        "pdserve:kv_host_tier_refused_states",
        "A hybrid model's recurrent states asked back from the host tier and refused (a shape "
        "or CRC that did not match); dropped and recomputed.",
        "kv_host_tier_states_refused",
    ),
    (
        "pdserve:kv_disk_tier_stored_blocks",
        "KV blocks written to the disk tier as the host tier pushed them out.",
        "kv_disk_tier_stored",
    ),
    (
        "pdserve:kv_disk_tier_restored_blocks",
        "KV blocks read back from the disk tier into the KV cache for a prompt.",
        "kv_disk_tier_restored",
    ),
    (
        "pdserve:kv_disk_tier_evicted_blocks",
        "KV blocks pushed out of the disk tier (their files deleted) to keep it within its cap.",
        "kv_disk_tier_evicted",
    ),
    (
        "pdserve:kv_disk_tier_dropped_blocks",
        "KV blocks the host tier pushed out that the disk tier dropped, its writer's queue being "
        "at its byte bound (recomputed when needed).",
        "kv_disk_tier_dropped",
    ),
    (
        "pdserve:kv_disk_tier_refused_blocks",
        "KV blocks read back from the disk tier and refused (a torn or damaged file, another "
        "layout, a chain or shape mismatch): deleted and recomputed.",
        "kv_disk_tier_refused",
    ),
    (
        "pdserve:kv_disk_tier_write_errors",
        "KV blocks whose disk tier file could not be written (disk full, I/O error): dropped "
        "from the tier and recomputed when needed.",
        "kv_disk_tier_write_errors",
    ),
    (
        "pdserve:peer_fetches",
        "Prefill workers: prompts whose cached prefix was pulled from a decode worker.",
        "peer_fetches",
    ),
    (
        "pdserve:peer_fetch_bytes",
        "Prefill workers: KV bytes pulled from decode workers (peer fetch).",
        "peer_fetch_bytes",
    ),
    (
        "pdserve:peer_fetch_seconds",
        "Prefill workers: seconds spent pulling KV from decode workers (peer fetch).",
        "peer_fetch_seconds",
    ),
    (
        "pdserve:peer_fetch_refused_blocks",
        "Prefill workers: fetched KV blocks refused (hash, digest, layout or size did not "
        "match) and recomputed instead.",
        "peer_fetch_refused_blocks",
    ),
    (
        "pdserve:peer_fetch_failures",
        "Prefill workers: peer fetches cut short (the decode worker gone, slow or its "
        "reservation ended); the rest was recomputed.",
        "peer_fetch_failures",
    ),
    (
        "pdserve:peer_fetch_served_blocks",
        "Decode workers: cached KV blocks served to prefill workers' peer fetches.",
        "peer_fetch_served_blocks",
    ),
    (
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine.",
        "num_preemptions",
    ),
    (
        "pdserve:kv_transfers",
        "KV hand-offs completed (prefill: pushed and flushed; decode: committed).",
        "kv_transfers",
    ),
    (
        "pdserve:kv_transfer_failures",
        "KV hand-offs that failed (prefill: channel or flush; decode: a bad frame or a refused "
        "commit).",
        "kv_transfer_failures",
    ),
    (
        "pdserve:kv_transfer_bytes",
        "KV bytes pushed (prefill workers) or received (decode workers).",
        "kv_transfer_bytes",
    ),
    (
        "pdserve:leases_expired",
        "Reservations freed because their lease ran out before the commit (decode workers).",
        "leases_expired",
    ),
    # speculative decoding (engine/spec/config.py); 0 on a worker that does not speculate
    (
        "vllm:spec_decode_num_drafts",
        "Number of spec decoding drafts (a sequence's step that verified guessed tokens).",
        "spec_drafts",
    ),
    (
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        "spec_draft_tokens",
    ),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        "spec_accepted_tokens",
    ),
    (
        "pdserve:spec_decode_draft_prefill_tokens",
        "Prompt tokens the draft model computed on the worker to catch up with its sequences, or "
        "an EAGLE head ran over (0 for ngram).",
        "spec_draft_prefill_tokens",
    ),
    # LoRA adapters (engine/lora.py); 0 where LoRA is off
    (
        "pdserve:lora_adapter_loads",
        "LoRA adapters read from disk into the worker's resident set (max_loras).",
        "lora_loads",
    ),
    (
        "pdserve:lora_adapter_evictions",
        "LoRA adapters evicted from the worker's resident set (least recently used first).",
        "lora_evictions",
    ),
)


WORKER_STATES = ("serving", "draining", "switching", "reconciling", "stuck")


class WorkerCollector(Collector):
    """Every worker's last WorkerStats as gauges and counters, read at scrape time from the pool
    (WorkerPool.snapshot: no RPC). A worker that has not answered a Stats call yet shows only in
    pdserve:worker_up; one marked down keeps its last figures and worker_up 0."""

    LABELS = ["model_name", "role", "worker"]

    def __init__(self, pool, model_name: str, colocated: bool = False):
        self.pool = pool
        self.model_name = model_name
        self.colocated = colocated

    def describe(self):
        return list(self._families().values())

    def _families(self) -> dict:
        gauge = lambda name, doc: GaugeMetricFamily(name, doc, labels=self.LABELS)  # noqa: E731
        fams = {
            "running": gauge(
                "vllm:num_requests_running", "Number of requests in model execution batches."
            ),
            "waiting": gauge(
                "vllm:num_requests_waiting", "Number of requests waiting to be processed."
            ),
            "kv": gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            "reserved": gauge(
                "pdserve:num_requests_reserved",
                "Decode reservations waiting for their KV and commit.",
            ),
            "queued": gauge(
                "pdserve:queued_prompt_tokens", "Prompt tokens waiting to be computed."
            ),
            "tier_bytes": gauge(
                "pdserve:kv_host_tier_bytes", "Bytes of KV blocks held in the host tier."
            ),
            "tier_cap": gauge(
                "pdserve:kv_host_tier_capacity_bytes", "The host tier's cap in bytes (0: off)."
            ),
            "disk_bytes": gauge(
                "pdserve:kv_disk_tier_bytes",
                "Bytes of KV block files held in the disk tier (written or queued).",
            ),
            "disk_cap": gauge(
                "pdserve:kv_disk_tier_capacity_bytes", "The disk tier's cap in bytes (0: off)."
            ),
            "lora_served": gauge(
                "pdserve:lora_adapters_served",
                "LoRA adapters the worker serves (its config's and those loaded at run time).",
            ),
            "lora_resident": gauge(
                "pdserve:lora_adapters_resident",
                "LoRA adapters whose weights are resident on the worker now (at most max_loras).",
            ),
            "up": gauge(
                "pdserve:worker_up",
                "1 when the worker's last Stats call answered, 0 when it is marked down.",
            ),
        }
        for name, doc, field in WORKER_COUNTERS:
            fams[field] = CounterMetricFamily(name, doc, labels=self.LABELS)
        fams.update(self._labelled_families())
        return fams

    def _labelled_families(self) -> dict:
        """The families with labels besides LABELS (a state, a source, a position, a backend,
        the cache's config)."""
        fams = {}
        fams["state"] = GaugeMetricFamily(
            "pdserve:worker_state",
            "1 for the worker's state in its role: serving, a role flip's draining or "
            "switching (router/flips.py), or reconciling or stuck while the router drives it to "
            "its intended role (router/reconcile.py); the role label is its pool.",
            labels=self.LABELS + ["state"],
        )
        fams["hits_by_source"] = CounterMetricFamily(
            "pdserve:prefix_cache_hit_tokens_by_source",
            "Prefix cache hits in prompt tokens, by where their blocks were found: device (the "
            "KV cache), host (restored from the host tier's memory), disk (restored from its "
            "disk level) or peer (pulled from a decode worker that held them: peer fetch).",
            labels=self.LABELS + ["source"],
        )
        fams["spec_per_pos"] = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position (0: the first guessed token).",
            labels=self.LABELS + ["position"],
        )
        fams["push_bytes"] = CounterMetricFamily(
            "pdserve:kv_push_bytes",
            "KV bytes a prefill worker pushed, per KV backend (kvtransfer.backend auto mixes "
            "them); over pdserve:kv_push_seconds, the backend's bandwidth as served.",
            labels=self.LABELS + ["backend"],
        )
        fams["cache_config"] = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the worker's KV cache config, vLLM's: its block_size and its "
            "num_gpu_blocks (the KV cache's blocks, on whatever device holds them).",
            labels=self.LABELS + ["block_size", "num_gpu_blocks"],
        )
        fams["lora_info"] = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests, vLLM's: the adapters of the sequences running and "
            "waiting, max_lora; the value is the time of the report (unix seconds).",
            labels=self.LABELS + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        fams["sleep"] = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "1 for the worker engine's sleep state, vLLM's: awake, weights_offloaded (level 1) "
            "or discard_all (level 2).",
            labels=self.LABELS + ["sleep_state"],
        )
        fams["push_seconds"] = CounterMetricFamily(
            "pdserve:kv_push_seconds",
            "Seconds a prefill worker spent pushing KV, per KV backend: handing each frame to "
            "the transport, then the flush.",
            labels=self.LABELS + ["backend"],
        )
        return fams

    def collect(self):
        fams, now = self._families(), time.time()
        for role, name, stats, down, state in self.pool.snapshot():
            if self.colocated and role == "decode":
                role = "colocated"
            labels = [self.model_name, role, name]
            fams["up"].add_metric(labels, 0.0 if down else 1.0)
            for one in WORKER_STATES:
                fams["state"].add_metric(labels + [one], 1.0 if state == one else 0.0)
            if stats is None:
                continue
            fams["running"].add_metric(labels, stats.num_running)
            fams["waiting"].add_metric(labels, stats.num_waiting)
            total = stats.num_total_blocks
            fams["kv"].add_metric(labels, (total - stats.num_free_blocks) / total if total else 0.0)
            fams["reserved"].add_metric(labels, stats.num_reserved)
            config = [str(stats.block_size), str(total)]
            fams["cache_config"].add_metric(labels + config, 1.0)
            if stats.lora_max:
                adapters = [",".join(stats.lora_running), ",".join(stats.lora_waiting)]
                fams["lora_info"].add_metric(labels + [str(stats.lora_max), *adapters], now)
            for level, one in enumerate(SLEEP_STATES):
                fams["sleep"].add_metric(labels + [one], float(stats.sleep_level == level))
            fams["queued"].add_metric(labels, stats.queued_prompt_tokens)
            fams["tier_bytes"].add_metric(labels, stats.kv_host_tier_bytes)
            fams["tier_cap"].add_metric(labels, stats.kv_host_tier_capacity_bytes)
            fams["disk_bytes"].add_metric(labels, stats.kv_disk_tier_bytes)
            fams["disk_cap"].add_metric(labels, stats.kv_disk_tier_capacity_bytes)
            fams["lora_served"].add_metric(labels, stats.lora_adapters_count)
            fams["lora_resident"].add_metric(labels, len(stats.lora_resident))
            fams["hits_by_source"].add_metric(labels + ["device"], stats.prefix_hit_tokens_device)
            fams["hits_by_source"].add_metric(labels + ["host"], stats.prefix_hit_tokens_host)
            fams["hits_by_source"].add_metric(labels + ["peer"], stats.prefix_hit_tokens_peer)
            fams["hits_by_source"].add_metric(labels + ["disk"], stats.prefix_hit_tokens_disk)
            for _, _, field in WORKER_COUNTERS:
                fams[field].add_metric(labels, getattr(stats, field))
            for position, accepted in enumerate(stats.spec_accepted_per_pos):
                fams["spec_per_pos"].add_metric(labels + [str(position)], accepted)
            for backend, pushed in sorted(stats.kv_push_bytes_by_backend.items()):
                fams["push_bytes"].add_metric(labels + [backend], pushed)
            for backend, seconds in sorted(stats.kv_push_seconds_by_backend.items()):
                fams["push_seconds"].add_metric(labels + [backend], seconds)
        return list(fams.values())
