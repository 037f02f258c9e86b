from pdserve.protos.pdserve.v1 import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_ms", "run_prefill", "min_cached_tokens", "priority", "share_tag", "lora_name", "stream_interval", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIN_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SHARE_TAG_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    lease_ms: int
    run_prefill: bool
    min_cached_tokens: int
    priority: int
    share_tag: int
    lora_name: str
    stream_interval: int
    images: PixelValues
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., lease_ms: _Optional[int] = ..., run_prefill: _Optional[bool] = ..., min_cached_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., share_tag: _Optional[int] = ..., lora_name: _Optional[str] = ..., stream_interval: _Optional[int] = ..., images: _Optional[_Union[PixelValues, _Mapping]] = ...) -> None: ...

class PixelValues(_message.Message):
    __slots__ = ("shape", "data", "image_sizes", "pixel_attention_mask", "image_grid_thw")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZES_FIELD_NUMBER: _ClassVar[int]
    PIXEL_ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    image_sizes: _containers.RepeatedScalarFieldContainer[int]
    pixel_attention_mask: bytes
    image_grid_thw: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., image_sizes: _Optional[_Iterable[int]] = ..., pixel_attention_mask: _Optional[bytes] = ..., image_grid_thw: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEndpoint(_message.Message):
    __slots__ = ("backend", "address", "layout_fingerprint", "tp_size", "rank_addresses", "write_grant", "offers", "locality", "host", "cross_host_rank")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    WRITE_GRANT_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CROSS_HOST_RANK_FIELD_NUMBER: _ClassVar[int]
    backend: str
    address: str
    layout_fingerprint: str
    tp_size: int
    rank_addresses: _containers.RepeatedScalarFieldContainer[str]
    write_grant: str
    offers: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    locality: str
    host: str
    cross_host_rank: int
    def __init__(self, backend: _Optional[str] = ..., address: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., tp_size: _Optional[int] = ..., rank_addresses: _Optional[_Iterable[str]] = ..., write_grant: _Optional[str] = ..., offers: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., locality: _Optional[str] = ..., host: _Optional[str] = ..., cross_host_rank: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("request_id", "block_ids", "block_size", "num_cached_tokens", "endpoint", "lease_deadline_unix_ns", "lora_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    LORA_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_cached_tokens: int
    endpoint: KVEndpoint
    lease_deadline_unix_ns: int
    lora_hash: bytes
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., endpoint: _Optional[_Union[KVEndpoint, _Mapping]] = ..., lease_deadline_unix_ns: _Optional[int] = ..., lora_hash: _Optional[bytes] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class StreamsRequest(_message.Message):
    __slots__ = ("attach", "detach")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    attach: _containers.RepeatedScalarFieldContainer[str]
    detach: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, attach: _Optional[_Iterable[str]] = ..., detach: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestEvents(_message.Message):
    __slots__ = ("request_id", "events", "end", "error_code", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    end: bool
    error_code: int
    error: str
    def __init__(self, request_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., end: _Optional[bool] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class StreamsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestEvents]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestEvents, _Mapping]]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_str", "stop_token", "timings", "index", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "num_cached_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    stop_str: str
    stop_token: int
    timings: _pdserve_pb2.Timings
    index: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TopLogprobs]
    num_cached_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., stop_str: _Optional[str] = ..., stop_token: _Optional[int] = ..., timings: _Optional[_Union[_pdserve_pb2.Timings, _Mapping]] = ..., index: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TopLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "reservation", "priority", "share_tag", "lora_name", "peer_fetch", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SHARE_TAG_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    reservation: ReserveResponse
    priority: int
    share_tag: int
    lora_name: str
    peer_fetch: PeerFetch
    images: PixelValues
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., reservation: _Optional[_Union[ReserveResponse, _Mapping]] = ..., priority: _Optional[int] = ..., share_tag: _Optional[int] = ..., lora_name: _Optional[str] = ..., peer_fetch: _Optional[_Union[PeerFetch, _Mapping]] = ..., images: _Optional[_Union[PixelValues, _Mapping]] = ...) -> None: ...

class PeerFetch(_message.Message):
    __slots__ = ("address", "max_blocks", "max_bytes", "timeout_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    max_blocks: int
    max_bytes: int
    timeout_ms: int
    def __init__(self, address: _Optional[str] = ..., max_blocks: _Optional[int] = ..., max_bytes: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("request_id", "first_block", "num_blocks", "max_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block: int
    num_blocks: int
    max_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class FetchKVBlock(_message.Message):
    __slots__ = ("index", "block_hash", "data", "digest", "layout_fingerprint", "state", "state_digest")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    index: int
    block_hash: bytes
    data: bytes
    digest: bytes
    layout_fingerprint: str
    state: bytes
    state_digest: bytes
    def __init__(self, index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., digest: _Optional[bytes] = ..., layout_fingerprint: _Optional[str] = ..., state: _Optional[bytes] = ..., state_digest: _Optional[bytes] = ...) -> None: ...

class WorkerEmbedRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "priority", "share_tag", "pooling", "normalize", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SHARE_TAG_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenIds]
    priority: int
    share_tag: int
    pooling: str
    normalize: bool
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[_pdserve_pb2.TokenIds, _Mapping]]] = ..., priority: _Optional[int] = ..., share_tag: _Optional[int] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ..., lora_name: _Optional[str] = ...) -> None: ...

class WorkerEmbedResponse(_message.Message):
    __slots__ = ("embeddings", "num_cached_tokens")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.Embedding]
    num_cached_tokens: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_pdserve_pb2.Embedding, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "num_cached_tokens", "bytes_sent", "timings", "first_tokens", "first_token_logprobs", "first_token_top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "peer_fetched_tokens", "peer_fetch_bytes", "peer_fetch_seconds", "peer_fetch_refused_blocks", "peer_fetch_skipped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_REFUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_cached_tokens: int
    bytes_sent: int
    timings: _pdserve_pb2.Timings
    first_tokens: _containers.RepeatedScalarFieldContainer[int]
    first_token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    first_token_top_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TopLogprobs]
    peer_fetched_tokens: int
    peer_fetch_bytes: int
    peer_fetch_seconds: float
    peer_fetch_refused_blocks: int
    peer_fetch_skipped: str
    def __init__(self, request_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., timings: _Optional[_Union[_pdserve_pb2.Timings, _Mapping]] = ..., first_tokens: _Optional[_Iterable[int]] = ..., first_token_logprobs: _Optional[_Iterable[float]] = ..., first_token_top_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TopLogprobs, _Mapping]]] = ..., peer_fetched_tokens: _Optional[int] = ..., peer_fetch_bytes: _Optional[int] = ..., peer_fetch_seconds: _Optional[float] = ..., peer_fetch_refused_blocks: _Optional[int] = ..., peer_fetch_skipped: _Optional[str] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("want_kv_events", "kv_events_epoch", "kv_events_after")
    WANT_KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    want_kv_events: bool
    kv_events_epoch: int
    kv_events_after: int
    def __init__(self, want_kv_events: _Optional[bool] = ..., kv_events_epoch: _Optional[int] = ..., kv_events_after: _Optional[int] = ...) -> None: ...

class KVEventRun(_message.Message):
    __slots__ = ("kind", "tier", "block_hashes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    tier: str
    block_hashes: bytes
    def __init__(self, kind: _Optional[str] = ..., tier: _Optional[str] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("epoch", "last_seq", "reset", "runs", "snapshot", "truncated", "host_snapshot", "state_snapshot", "states")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    HOST_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STATE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    last_seq: int
    reset: bool
    runs: _containers.RepeatedCompositeFieldContainer[KVEventRun]
    snapshot: bytes
    truncated: bool
    host_snapshot: bytes
    state_snapshot: bytes
    states: bool
    def __init__(self, epoch: _Optional[int] = ..., last_seq: _Optional[int] = ..., reset: _Optional[bool] = ..., runs: _Optional[_Iterable[_Union[KVEventRun, _Mapping]]] = ..., snapshot: _Optional[bytes] = ..., truncated: _Optional[bool] = ..., host_snapshot: _Optional[bytes] = ..., state_snapshot: _Optional[bytes] = ..., states: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "num_reserved", "queued_prompt_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_transfers", "kv_transfer_failures", "kv_transfer_bytes", "leases_expired", "engine_stalled_ms", "engine_turn_cpu_ms", "engine_idle_ms", "role", "role_state", "role_version", "block_size", "structured_rows", "structured_mask_ns", "grammar_compiles", "grammar_compile_ns", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos", "spec_draft_prefill_tokens", "engine_turn_ms_max", "engine_turn_tokens", "engine_us_per_token_max", "kv_events", "kv_host_tier_bytes", "kv_host_tier_capacity_bytes", "kv_host_tier_stored", "kv_host_tier_restored", "kv_host_tier_evicted", "prefix_hit_tokens_device", "prefix_hit_tokens_host", "kv_host_tier_capacity_blocks", "kv_host_tier_refused", "kv_host_tier_states_stored", "kv_host_tier_states_restored", "kv_host_tier_states_refused", "kv_push_bytes_by_backend", "kv_push_seconds_by_backend", "lora_adapters", "lora_adapters_count", "lora_resident", "lora_loads", "lora_evictions", "lora_running", "lora_waiting", "lora_max", "prefix_hit_tokens_peer", "peer_fetches", "peer_fetch_bytes", "peer_fetch_seconds", "peer_fetch_refused_blocks", "peer_fetch_failures", "peer_fetch_served_blocks", "peer_fetch_served_bytes", "kv_disk_tier_bytes", "kv_disk_tier_capacity_bytes", "kv_disk_tier_stored", "kv_disk_tier_restored", "kv_disk_tier_evicted", "prefix_hit_tokens_disk", "kv_disk_tier_dropped", "kv_disk_tier_refused", "kv_disk_tier_write_errors", "weight_version", "weights_path", "engine_loading_weights", "engine_ranks", "sleep_level", "asleep_tags")
    class KvPushBytesByBackendEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvPushSecondsByBackendEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STALLED_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TURN_CPU_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_STATE_FIELD_NUMBER: _ClassVar[int]
    ROLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_ROWS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_MASK_NS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILE_NS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TURN_MS_MAX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TURN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_US_PER_TOKEN_MAX_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_RESTORED_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_DEVICE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_STATES_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_STATES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_TIER_STATES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_BYTES_BY_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_SECONDS_BY_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_COUNT_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LORA_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LORA_WAITING_FIELD_NUMBER: _ClassVar[int]
    LORA_MAX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_PEER_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_REFUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_SERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_RESTORED_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_TIER_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOADING_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RANKS_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_TAGS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int
    queued_prompt_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_transfers: int
    kv_transfer_failures: int
    kv_transfer_bytes: int
    leases_expired: int
    engine_stalled_ms: int
    engine_turn_cpu_ms: int
    engine_idle_ms: int
    role: str
    role_state: str
    role_version: int
    block_size: int
    structured_rows: int
    structured_mask_ns: int
    grammar_compiles: int
    grammar_compile_ns: int
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    spec_draft_prefill_tokens: int
    engine_turn_ms_max: int
    engine_turn_tokens: int
    engine_us_per_token_max: int
    kv_events: KVEvents
    kv_host_tier_bytes: int
    kv_host_tier_capacity_bytes: int
    kv_host_tier_stored: int
    kv_host_tier_restored: int
    kv_host_tier_evicted: int
    prefix_hit_tokens_device: int
    prefix_hit_tokens_host: int
    kv_host_tier_capacity_blocks: int
    kv_host_tier_refused: int
    kv_host_tier_states_stored: int
    kv_host_tier_states_restored: int
    kv_host_tier_states_refused: int
    kv_push_bytes_by_backend: _containers.ScalarMap[str, int]
    kv_push_seconds_by_backend: _containers.ScalarMap[str, float]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_adapters_count: int
    lora_resident: _containers.RepeatedScalarFieldContainer[str]
    lora_loads: int
    lora_evictions: int
    lora_running: _containers.RepeatedScalarFieldContainer[str]
    lora_waiting: _containers.RepeatedScalarFieldContainer[str]
    lora_max: int
    prefix_hit_tokens_peer: int
    peer_fetches: int
    peer_fetch_bytes: int
    peer_fetch_seconds: float
    peer_fetch_refused_blocks: int
    peer_fetch_failures: int
    peer_fetch_served_blocks: int
    peer_fetch_served_bytes: int
    kv_disk_tier_bytes: int
    kv_disk_tier_capacity_bytes: int
    kv_disk_tier_stored: int
    kv_disk_tier_restored: int
    kv_disk_tier_evicted: int
    prefix_hit_tokens_disk: int
    kv_disk_tier_dropped: int
    kv_disk_tier_refused: int
    kv_disk_tier_write_errors: int
    weight_version: str
    weights_path: str
    engine_loading_weights: bool
    engine_ranks: int
    sleep_level: int
    asleep_tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_reserved: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_transfers: _Optional[int] = ..., kv_transfer_failures: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., leases_expired: _Optional[int] = ..., engine_stalled_ms: _Optional[int] = ..., engine_turn_cpu_ms: _Optional[int] = ..., engine_idle_ms: _Optional[int] = ..., role: _Optional[str] = ..., role_state: _Optional[str] = ..., role_version: _Optional[int] = ..., block_size: _Optional[int] = ..., structured_rows: _Optional[int] = ..., structured_mask_ns: _Optional[int] = ..., grammar_compiles: _Optional[int] = ..., grammar_compile_ns: _Optional[int] = ..., spec_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_accepted_per_pos: _Optional[_Iterable[int]] = ..., spec_draft_prefill_tokens: _Optional[int] = ..., engine_turn_ms_max: _Optional[int] = ..., engine_turn_tokens: _Optional[int] = ..., engine_us_per_token_max: _Optional[int] = ..., kv_events: _Optional[_Union[KVEvents, _Mapping]] = ..., kv_host_tier_bytes: _Optional[int] = ..., kv_host_tier_capacity_bytes: _Optional[int] = ..., kv_host_tier_stored: _Optional[int] = ..., kv_host_tier_restored: _Optional[int] = ..., kv_host_tier_evicted: _Optional[int] = ..., prefix_hit_tokens_device: _Optional[int] = ..., prefix_hit_tokens_host: _Optional[int] = ..., kv_host_tier_capacity_blocks: _Optional[int] = ..., kv_host_tier_refused: _Optional[int] = ..., kv_host_tier_states_stored: _Optional[int] = ..., kv_host_tier_states_restored: _Optional[int] = ..., kv_host_tier_states_refused: _Optional[int] = ..., kv_push_bytes_by_backend: _Optional[_Mapping[str, int]] = ..., kv_push_seconds_by_backend: _Optional[_Mapping[str, float]] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_adapters_count: _Optional[int] = ..., lora_resident: _Optional[_Iterable[str]] = ..., lora_loads: _Optional[int] = ..., lora_evictions: _Optional[int] = ..., lora_running: _Optional[_Iterable[str]] = ..., lora_waiting: _Optional[_Iterable[str]] = ..., lora_max: _Optional[int] = ..., prefix_hit_tokens_peer: _Optional[int] = ..., peer_fetches: _Optional[int] = ..., peer_fetch_bytes: _Optional[int] = ..., peer_fetch_seconds: _Optional[float] = ..., peer_fetch_refused_blocks: _Optional[int] = ..., peer_fetch_failures: _Optional[int] = ..., peer_fetch_served_blocks: _Optional[int] = ..., peer_fetch_served_bytes: _Optional[int] = ..., kv_disk_tier_bytes: _Optional[int] = ..., kv_disk_tier_capacity_bytes: _Optional[int] = ..., kv_disk_tier_stored: _Optional[int] = ..., kv_disk_tier_restored: _Optional[int] = ..., kv_disk_tier_evicted: _Optional[int] = ..., prefix_hit_tokens_disk: _Optional[int] = ..., kv_disk_tier_dropped: _Optional[int] = ..., kv_disk_tier_refused: _Optional[int] = ..., kv_disk_tier_write_errors: _Optional[int] = ..., weight_version: _Optional[str] = ..., weights_path: _Optional[str] = ..., engine_loading_weights: _Optional[bool] = ..., engine_ranks: _Optional[int] = ..., sleep_level: _Optional[int] = ..., asleep_tags: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class RoleStatus(_message.Message):
    __slots__ = ("worker_id", "role", "state", "remaining", "switch_ms", "role_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    ROLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    state: str
    remaining: str
    switch_ms: int
    role_version: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., remaining: _Optional[str] = ..., switch_ms: _Optional[int] = ..., role_version: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "state", "address", "stats", "intended_role", "intended_state", "reported_role", "reported_state", "reported_age_ms", "mismatch", "stuck")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    INTENDED_ROLE_FIELD_NUMBER: _ClassVar[int]
    INTENDED_STATE_FIELD_NUMBER: _ClassVar[int]
    REPORTED_ROLE_FIELD_NUMBER: _ClassVar[int]
    REPORTED_STATE_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    STUCK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    state: str
    address: str
    stats: WorkerStats
    intended_role: str
    intended_state: str
    reported_role: str
    reported_state: str
    reported_age_ms: int
    mismatch: bool
    stuck: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., address: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ..., intended_role: _Optional[str] = ..., intended_state: _Optional[str] = ..., reported_role: _Optional[str] = ..., reported_state: _Optional[str] = ..., reported_age_ms: _Optional[int] = ..., mismatch: _Optional[bool] = ..., stuck: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class FlipRequest(_message.Message):
    __slots__ = ("worker_id", "role", "drain_timeout_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    drain_timeout_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., drain_timeout_ms: _Optional[int] = ...) -> None: ...

class FlipResponse(_message.Message):
    __slots__ = ("worker_id", "from_role", "role", "drain_ms", "switch_ms", "moved_streams")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_MS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    MOVED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    from_role: str
    role: str
    drain_ms: int
    switch_ms: int
    moved_streams: int
    def __init__(self, worker_id: _Optional[str] = ..., from_role: _Optional[str] = ..., role: _Optional[str] = ..., drain_ms: _Optional[int] = ..., switch_ms: _Optional[int] = ..., moved_streams: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv", "model", "deployment_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    kv: KVEndpoint
    model: _pdserve_pb2.ModelCard
    deployment_id: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., kv: _Optional[_Union[KVEndpoint, _Mapping]] = ..., model: _Optional[_Union[_pdserve_pb2.ModelCard, _Mapping]] = ..., deployment_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_ms",)
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ms: int
    def __init__(self, heartbeat_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class LoadLoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "if_absent")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    if_absent: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., if_absent: _Optional[bool] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path", "weight_version")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: str
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("model_path", "weight_version")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: str
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class InitWeightsGroupRequest(_message.Message):
    __slots__ = ("group_name", "master_address", "master_port", "rank_offset", "world_size", "timeout_s")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float
    def __init__(self, group_name: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightsGroupResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: int
    def __init__(self, ranks: _Optional[int] = ...) -> None: ...

class UpdateWeightsFromGroupRequest(_message.Message):
    __slots__ = ("group_name", "names", "dtypes", "dims", "ndims", "weight_version", "source", "transfer_id")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    NDIMS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    names: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    dims: _containers.RepeatedScalarFieldContainer[int]
    ndims: _containers.RepeatedScalarFieldContainer[int]
    weight_version: str
    source: str
    transfer_id: str
    def __init__(self, group_name: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[str]] = ..., dims: _Optional[_Iterable[int]] = ..., ndims: _Optional[_Iterable[int]] = ..., weight_version: _Optional[str] = ..., source: _Optional[str] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class DestroyWeightsGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class DestroyWeightsGroupResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class SleepStatus(_message.Message):
    __slots__ = ("level", "asleep_tags")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_TAGS_FIELD_NUMBER: _ClassVar[int]
    level: int
    asleep_tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, level: _Optional[int] = ..., asleep_tags: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("external",)
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    external: bool
    def __init__(self, external: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class LoRAAdapters(_message.Message):
    __slots__ = ("adapters", "found")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    found: bool
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., found: _Optional[bool] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "path", "rank", "content_hash")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    content_hash: bytes
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., content_hash: _Optional[bytes] = ...) -> None: ...
