"""The deployment YAML's keys as one frozen, validated schema (DeployConfig and its sections). The
schema is built once, when `pdserve up` loads a file (load.py), and is then only read: by the
launcher, the pre-start checks and the router it starts. Validators turn every mistake into a
message under its key; files the YAML names are read here (files.py) so workers get bytes, not
paths.

    model: smollm2
    pools:
      prefill: {replicas: 1, tp: 1, resources: {num_cpus: 1}}
      decode:  {replicas: 1, tp: 1, resources: {num_cpus: 1}}   # or instead: colocated: {...}
      # resources also take Ray custom resources ({num_cpus: 1, node2: 1}); label_selector: the
      # Ray node labels a pool's nodes must have ({kind: big-memory}); docs/ray-cluster.md
    router: {host: 127.0.0.1, port: 50051}   # also tls, http_port (null: off), api_keys(_file),
                                             # metrics_keys_file (the /metrics scrape's own keys),
                                             # local_prefill, peer_fetch
    kvtransfer: {backend: auto}   # shm on one machine, grpc between; or grpc, shm, torch, nixl
    ray: {address: null}          # null: start a local Ray; "auto" or "host:port": join a cluster
                                  # (dashboard: true turns on a local Ray's dashboard; bind:
                                  # loopback keeps a local Ray's ports on 127.0.0.1, the default)
    security: {cluster_secret_file: null, tls: null}   # between the deployment's own processes
    planner: {enabled: false}     # role flips and local prefill moved while traffic shifts

SecuritySettings.secret says where the cluster secret comes from, RouterSettings.client_keys the
client API keys.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SecretStr,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from pdserve.deploy.config.files import (
    API_KEYS_ENV,
    MAX_API_KEYS,
    SECRET_ENV,
    CertFile,
    ChatTemplate,
    KeyFile,
    KeysFile,
    ProfileFile,
    SecretFile,
    check_secret,
    parse_api_keys,
)
from pdserve.deploy.config.ray_keys import custom_resource_problem, label_selector_problem
from pdserve.engine.loader.generation_config import check_override
from pdserve.engine.spec.config import HEAD_METHODS
from pdserve.protos.limits import MAX_STREAM_INTERVAL, image_limit, mm_processor_kwargs
from pdserve.protos.media_domains import MAX_MEDIA_DOMAINS, check_media_domain
from pdserve.protos.security import ClusterSecurity, TLSConfig, check_api_key

DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16")  # engine/config.py
QUANTIZATIONS = (None, "int8", "int4", "bf16", "auto")
# the start of the refusal of a router whose HTTP and gRPC ports are one (`pdserve up` adds a note
# on vLLM's --port, which is its HTTP port, when it sees it)
PORT_CLASH = "http_port and port are both"


class _Frozen(BaseModel):
    # strict: YAML gives real types, so "2" for an integer is a mistake worth reporting
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Resources(_Frozen):
    """What one TP rank of a replica reserves (one placement-group bundle): CPUs, GPUs, and any
    Ray custom resources by name (`{num_cpus: 1, node2: 1}`: only nodes started with
    `ray start --resources '{"node2": N}'` can hold it), so a pool lands on the nodes chosen."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    num_cpus: Annotated[float, Field(ge=0)] = 1
    num_gpus: Annotated[float, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _not_empty(self):
        if self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError(
                "num_cpus and num_gpus cannot both be 0 (a worker needs somewhere to run)"
            )
        for name, amount in self.custom().items():
            problem = custom_resource_problem(name, amount)
            if problem:
                raise ValueError(problem)
        return self

    def custom(self) -> dict[str, float]:
        """The Ray custom resources asked for, by name."""
        return dict(self.model_extra or {})

    def bundle(self) -> dict[str, float]:
        """A Ray placement-group bundle; zero amounts are left out (Ray rejects empty resources)."""
        base = {k: v for k, v in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if v > 0}
        return {**base, **{k: float(v) for k, v in self.custom().items()}}


class Pool(_Frozen):
    replicas: Annotated[int, Field(ge=1)] = 1
    tp: Annotated[int, Field(ge=1)] = 1
    # pipeline stages of each worker (vLLM's pipeline_parallel_size), tp ranks each: prefill pools
    # only (a decode step would pay every stage per token); such workers do not flip roles
    pp: Annotated[int, Field(ge=1)] = 1
    # how Ray may place a pipelined worker's stages (deploy/placement.py): "pack" keeps its ranks
    # on as few nodes as hold them (Ray's PACK: one node when one can, else they spread);
    # "spread" puts every stage on a node of its own (STRICT_SPREAD; needs tp 1 and pp nodes)
    stage_placement: Literal["pack", "spread"] = "pack"
    resources: Resources = Resources()
    # bytes (an integer) or a fraction of free memory in (0, 1]; unset: the engine's default
    kv_cache_memory: StrictInt | StrictFloat | None = None
    block_size: Annotated[int, Field(ge=1)] = 16
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 2048
    # a prompt longer than max_num_batched_tokens runs in chunks of about this many seconds (sized
    # from the measured step time), and short prompts arriving meanwhile go first
    # (engine/scheduler.py); 0: off, every chunk takes the whole token budget
    prefill_step_target_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.5
    max_num_seqs: Annotated[int, Field(ge=1)] = 128
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    enable_prefix_caching: bool = True
    # bytes of host memory each worker keeps evicted prefix-cache blocks in (a host tier below
    # its KV cache, engine/kv_host_tier.py), restored when a later prompt needs them; 0: off.
    # Pays on decode pools, where a conversation's blocks live; needs enable_prefix_caching
    kv_host_tier_bytes: Annotated[int, Field(ge=0, strict=True)] = 0
    # bytes of files each worker keeps the blocks its host tier pushes out in (a disk tier below
    # it, engine/kv_disk_tier.py), read back when a later prompt needs them; 0: off. Needs
    # kv_host_tier_bytes > 0. kv_disk_tier_dir: where each worker makes its own directory of
    # them (created 0700, removed at shutdown); null: the pdserve cache dir's kv-disk-tier/
    kv_disk_tier_bytes: Annotated[int, Field(ge=0, strict=True)] = 0
    kv_disk_tier_dir: Annotated[str, Field(min_length=1)] | None = None
    # torch compute threads of each worker process; None: resources.num_cpus (at least 1). More
    # threads than reserved CPUs suit a pool that is idle while the other computes (prefill on a
    # small machine), at the price of contention when both are busy
    num_threads: Annotated[int, Field(ge=1)] | None = None
    # Ray node labels every replica's node must match (Ray's label selectors: `{zone: us-a}`,
    # `{gpu: "!a10"}`, `{zone: "in(a,b)"}`); nodes get labels from `ray start --labels k=v`
    label_selector: dict[str, str] | None = None
    # speculative decoding, vLLM's mapping (engine/spec/config.py): {method: ngram,
    # num_speculative_tokens: 4}; decode and colocated pools only (a decode pool's EAGLE head
    # runs on the prefill pool too: engine_kwargs). "auto" (unset): the engine's default
    # (prompt lookup in the default mode on a CPU); null: off
    speculative_config: dict | Literal["auto"] | None = "auto"

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, v):
        # The engine's own check, before any model loads; the key in front names the mapping.
        from pdserve.engine.spec.config import SpeculativeConfig

        try:
            return v if v in (None, "auto") else SpeculativeConfig.parse(v).to_dict()
        except ValueError as e:
            msg = str(e).removeprefix("speculative_config.").removeprefix("speculative_config ")
            raise ValueError(msg) from None

    @field_validator("label_selector")
    @classmethod
    def _labels(cls, v):
        if v:
            problem = label_selector_problem(v)
            if problem:
                raise ValueError(problem)
        return v

    @property
    def threads(self) -> int:
        return self.num_threads or max(1, int(self.resources.num_cpus))

    @property
    def compute(self) -> float:
        """One worker's compute for one prompt, in devices: tp ranks of resources.num_gpus GPUs
        each, or of resources.num_cpus cores on a CPU pool. Pipeline stages run one prompt's
        layers one after another, so pp adds none. Only the ratio between pools means anything
        (the local-prefill rule's cost "auto")."""
        r = self.resources
        return self.tp * (r.num_gpus if r.num_gpus > 0 else r.num_cpus)

    @property
    def ranks(self) -> int:
        """Processes of one worker: tp ranks in each of pp stages (a resources bundle each)."""
        return self.tp * self.pp

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _kv_memory(cls, v):
        # before the Union runs, so a bad value gets one message instead of one per member
        if v is None or (type(v) is int and v > 0) or (type(v) is float and 0 < v <= 1):
            return v
        raise ValueError("must be bytes (an integer > 0) or a fraction of free memory in (0, 1]")

    @model_validator(mode="after")
    def _spread_stages(self):
        if self.stage_placement == "spread" and self.tp > 1:
            raise ValueError(
                f"stage_placement 'spread' puts every rank on a node of its own, which would "
                f"split each stage's tp {self.tp} ranks across nodes: use 'pack', or tp 1"
            )
        return self

    @model_validator(mode="after")
    def _host_tier_needs_prefix_cache(self):
        if self.kv_host_tier_bytes and not self.enable_prefix_caching:
            raise ValueError(
                "kv_host_tier_bytes needs enable_prefix_caching: the host tier holds evicted "
                "prefix-cache blocks (set kv_host_tier_bytes: 0 or enable_prefix_caching: true)"
            )
        if self.kv_disk_tier_bytes and not self.kv_host_tier_bytes:
            raise ValueError(
                "kv_disk_tier_bytes needs kv_host_tier_bytes > 0: the disk tier holds what the "
                "host tier pushes out (set kv_disk_tier_bytes: 0 or give kv_host_tier_bytes)"
            )
        if self.kv_disk_tier_dir is not None and not self.kv_disk_tier_bytes:
            raise ValueError(
                "kv_disk_tier_dir is set but kv_disk_tier_bytes is 0 (the disk tier is off): "
                "give kv_disk_tier_bytes or drop kv_disk_tier_dir"
            )
        return self

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v):
        if v & (v - 1):
            raise ValueError("must be a power of two")
        return v


class Pools(_Frozen):
    prefill: Pool = Pool()
    decode: Pool = Pool()
    # colocated serving: workers that prefill and decode together (chunked prefill inside
    # continuous batching) behind the same router, instead of the prefill and decode pools
    colocated: Pool | None = None

    @field_validator("prefill")
    @classmethod
    def _prefill_never_speculates(cls, v):
        if v.speculative_config not in (None, "auto"):
            raise ValueError(
                "speculative_config: prefill workers never decode, so they never speculate; "
                "set it on pools.decode (or pools.colocated)"
            )
        return v

    @model_validator(mode="after")
    def _stages_prefill_only(self):
        for key in ("decode", "colocated"):
            pool = getattr(self, key)
            if pool is not None and pool.pp > 1:
                raise ValueError(
                    f"{key}.pp must be 1: {key} workers decode, and a decode step in stages "
                    f"pays every stage per token (pipeline stages are for pools.prefill)"
                )
        return self

    @model_validator(mode="after")
    def _one_shape(self):
        if self.colocated is not None and self.model_fields_set & {"prefill", "decode"}:
            raise ValueError(
                "set either colocated or prefill/decode, not both (colocated workers "
                "prefill and decode themselves)"
            )
        return self


class LocalPrefillSettings(_Frozen):
    """router.local_prefill (planner/local_prefill.py): prompts of at most max_prompt_tokens run on
    their decode worker when cost x (its local backlog + the prompt) < the prefill pool's backlog
    + hop_tokens. 0: never (the default). A conversation's next turn whose decode worker holds
    all but at most reuse_max_new_tokens of it is asked the same of those new tokens only
    (0: never). max_step_slowdown x: beside running streams the decode pool's steps compute at
    most about x of a plain decode step in prompt tokens (its engines get it: a prompt runs in
    chunks there and the streams' steps take about 1 + x times as long), and the rule prices
    such a prompt's tokens (1 + x) / x times higher; 0: no bound. cost "auto": a prefill
    worker's compute over a decode worker's, from the pools' tp and resources (1 where the
    two are alike: Pool.compute)."""

    max_prompt_tokens: Annotated[int, Field(ge=0)] = 0
    cost: float | Literal["auto"] = "auto"
    hop_tokens: Annotated[int, Field(ge=0)] = 64
    reuse_max_new_tokens: Annotated[int, Field(ge=0)] = 512
    # (planner/local_prefill.py MAX_STEP_SLOWDOWN, the rule's own default)
    max_step_slowdown: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.1

    @field_validator("cost", mode="before")
    @classmethod
    def _cost(cls, v):
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if v != "auto" and not (number and 0 < v < float("inf")):
            raise ValueError('must be a number > 0 or "auto"')
        return float(v) if number else v


class PeerFetchSettings(_Frozen):
    """router.peer_fetch (router/peer_fetch.py): a conversation's turn that goes through the
    prefill pool has its prefill worker pull the cached prefix its decode worker holds (instead
    of recomputing it) when estimated faster, from the measured hand-off bandwidth and prefill
    speed; at most max_blocks blocks, max_bytes bytes and timeout_s seconds per fetch (what
    arrived by then is used, the rest computed); a smaller gain than min_tokens is recomputed."""

    enabled: bool = True
    max_blocks: Annotated[int, Field(ge=1, le=65536)] = 4096
    max_bytes: Annotated[int, Field(ge=1)] = 1 << 30
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    min_tokens: Annotated[int, Field(ge=0)] = 32


class ClusterTLS(_Frozen):
    """Mutual TLS between the deployment's processes: every certificate signed by ca_file."""

    ca_file: CertFile
    cert_file: CertFile
    key_file: KeyFile
    server_name: str = ""  # the name in the certificates, when it is not the host dialled

    def tls_config(self) -> TLSConfig:
        return TLSConfig(
            self.ca_file.data, self.cert_file.data, self.key_file.data, self.server_name
        )


class RouterTLS(_Frozen):
    """TLS on the client-facing port; with ca_file, clients must show a certificate it signed.
    It needs security.tls too, because the workers register through that port."""

    cert_file: CertFile
    key_file: KeyFile
    ca_file: CertFile | None = None

    def tls_config(self) -> TLSConfig:
        return TLSConfig(
            self.ca_file.data if self.ca_file else b"", self.cert_file.data, self.key_file.data
        )


class SecuritySettings(_Frozen):
    """Security between the deployment's own processes. Secret and PEM files are read when the
    config is loaded, relative to the YAML file's folder."""

    cluster_secret: SecretStr | None = None  # SecretStr: a repr or log line shows ******
    cluster_secret_file: SecretFile | None = None
    tls: ClusterTLS | None = None

    @field_validator("cluster_secret")
    @classmethod
    def _secret_length(cls, v):
        if v is not None:
            check_secret(v.get_secret_value(), "")
        return v

    @field_validator("cluster_secret_file")
    @classmethod
    def _file_secret(cls, v):
        if v is None:
            return v
        try:
            text = v.data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{v.path} must hold the secret as UTF-8 text") from None
        check_secret(text, f"the secret in {v.path} ")
        return v

    @model_validator(mode="after")
    def _one_secret(self):
        if self.cluster_secret is not None and self.cluster_secret_file is not None:
            raise ValueError("set cluster_secret or cluster_secret_file, not both")
        return self

    def secret(self, environ=os.environ) -> tuple[str | None, str]:
        """(the cluster secret, which setting gave it); (None, "") when none did, and then
        `pdserve up` makes a fresh one. The first found wins: cluster_secret_file, cluster_secret,
        then the environment's PDSERVE_CLUSTER_SECRET. The file wins over the environment because
        it is the reviewed description of the deployment; the environment is for a secret that
        should be in no file. Every worker gets the secret from `up` with its config."""
        if self.cluster_secret_file is not None:
            return (
                self.cluster_secret_file.data.decode().strip(),
                f"security.cluster_secret_file ({self.cluster_secret_file.path})",
            )
        if self.cluster_secret is not None:
            return self.cluster_secret.get_secret_value(), "security.cluster_secret"
        value = environ.get(SECRET_ENV, "").strip()
        return (value, SECRET_ENV) if value else (None, "")

    def cluster_security(self, secret: str) -> ClusterSecurity:
        return ClusterSecurity(secret, self.tls.tls_config() if self.tls else None)


RETIRED_ROUTER_KEYS = {
    "prefill_timeout_s": (
        "a fixed bound cut long legitimate prefills. A prefill now ends when it answers, when the "
        "client's deadline passes or it cancels, or when its prefill worker is declared dead "
        "(worker_silence_s, worker_stall_s), then it is retried on another one; delete the key"
    ),
    "stats_timeout_s": (
        "a late Stats call no longer decides anything; set worker_down_s (silent this long: no "
        "new work) and worker_silence_s (silent this long: dead, its calls resume elsewhere)"
    ),
    "down_after": (
        "failed Stats calls are no longer counted; set worker_down_s and worker_silence_s "
        "(seconds without any answer) instead"
    ),
}


MAX_ORIGINS = 256
# an origin as a browser sends it in its Origin header: a scheme, a host and perhaps a port
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s\\]+")


def check_origin(origin: str, count: int) -> str:
    """`origin` (one of router.cors_allowed_origins' `count`) as browsers write it, lowercased;
    a ValueError that says the form for anything else."""
    if origin == "*":
        if count > 1:
            raise ValueError("'*' allows every origin: give it alone")
        return origin
    low = origin.strip().lower()
    if not _ORIGIN.fullmatch(low):
        raise ValueError(
            f"{origin[:200]!r} is not an origin: scheme://host[:port] with no path and no "
            "trailing slash, as browsers send it (e.g. http://localhost:3000), or '*' for any"
        )
    return low


class RouterSettings(_Frozen):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 50051  # 0: pick a free port
    max_inflight: Annotated[int, Field(ge=1)] = 64
    # past max_inflight, requests wait in the router's FIFO admission queue (router/admission.py):
    # at most max_queued of them (more: 429 / RESOURCE_EXHAUSTED), each at most
    # max_queue_wait_s (then 503 / UNAVAILABLE); 0 queued: refused at once past max_inflight
    max_queued: Annotated[int, Field(ge=0, le=8192)] = 1024  # each waiting one holds a thread
    max_queue_wait_s: Annotated[float, Field(gt=0)] = 60.0
    # vLLM's --scheduling-policy: "fcfs" refuses a request whose priority is not 0 (400 /
    # INVALID_ARGUMENT); "priority" runs the lower value first (first come first served within
    # equal values) in the admission and decode queues and in both workers' engines
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # /v1/embeddings and PDServe.Embed, on the prefill pool: the final hidden state of the last
    # token ("last", vLLM's default for decoder embedding models) or the mean over the prompt's
    # tokens ("mean"), L2-normalised unless embedding_normalize is false
    embedding_pooling: Literal["last", "mean"] = "last"
    embedding_normalize: bool = True
    # disaggregated: how long a request may wait in the router for decode KV blocks when every
    # decode worker is full, before it fails with RESOURCE_EXHAUSTED
    decode_queue_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    # vLLM's and SGLang's --stream-interval: decode workers send each stream's tokens in groups of
    # this many (the first token, and the stream's end, at once); larger costs the workers and
    # the router less per token at many streams and makes the text arrive in bursts
    stream_interval: Annotated[int, Field(ge=1, le=MAX_STREAM_INTERVAL)] = 1
    # bounds (docs/deploying.md): a role flip's drain, and a worker's health (router/pool.py):
    # silent (no Stats answer, no heartbeat) worker_down_s, no new work; silent worker_silence_s,
    # dead (its calls resume elsewhere); an engine stuck in one turn (computing, or not using the
    # CPU, for max(worker_stall_s, worker_stall_factor x its costliest recent turn's CPU time)),
    # dead
    worker_down_s: Annotated[float, Field(gt=0)] = 2.0
    worker_silence_s: Annotated[float, Field(ge=2)] = 4.0  # twice the 1 s heartbeat at least
    worker_stall_s: Annotated[float, Field(gt=0)] = 5.0
    worker_stall_factor: Annotated[float, Field(ge=1)] = 4.0
    flip_drain_s: Annotated[float, Field(gt=0)] = 5.0
    # a worker the router cannot bring to its intended role and state (router/reconcile.py)
    # within this long is skipped for new work, as a down worker is, and logged as an error
    reconcile_bound_s: Annotated[float, Field(gt=0)] = 10.0
    local_prefill: LocalPrefillSettings = LocalPrefillSettings()
    peer_fetch: PeerFetchSettings = PeerFetchSettings()
    tls: RouterTLS | None = None  # None: plaintext for clients (the client API needs no secret)
    # the OpenAI-compatible HTTP front on host:http_port (HTTPS with tls); 0: a free port;
    # null: no HTTP front. Unset: 8000, or 0 (a free port) when port is 0
    http_port: Annotated[int, Field(ge=0, le=65535)] | None = 8000
    # the HTTP front's bounds on a client (headers, then between body pieces; 0: derived cap)
    http_header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    http_body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    http_max_connections: Annotated[int, Field(ge=0)] = 0
    # /v1/responses: stored responses (previous_response_id, GET, DELETE) kept in the router's
    # memory, least recently used evicted past this many MiB; 0: nothing stored
    responses_store_mb: Annotated[int, Field(ge=0, le=1 << 20)] = 64
    # OpenAI's Files and Batch APIs (/v1/files, /v1/batches): the files, inputs and batch outputs,
    # kept on the router's disk (a private temporary folder, removed when it stops) up to this
    # many MiB; 0: neither API
    files_store_mb: Annotated[int, Field(ge=0, le=1 << 24)] = 1024
    # the folder the files and the batches are kept in, on the router's host, so that a router
    # started again on it lists them and goes on with the batches that had not ended; unset: a
    # private temporary folder, removed (with every file and batch) when the router stops
    files_dir: str | None = None
    # the Batch API's lines of all batches running at once, at most: the rest of max_inflight is
    # left to interactive requests, which the admission queue also puts ahead of a batch's
    batch_max_inflight: Annotated[int, Field(ge=1, le=4096)] = 16
    # the origins (scheme://host[:port]) whose web pages may call the HTTP front from a browser
    # (CORS, vLLM's --allowed-origins); ["*"]: any page. Empty, the default: none, since a front
    # without API keys would serve any page the operator opens (router/openai/app.py)
    cors_allowed_origins: Annotated[list[str], Field(max_length=MAX_ORIGINS)] = []
    # the hosts (and hosts under them) whose image links a chat may send, fetched by the router
    # (vLLM's --allowed-media-domains); []: no link is fetched, images come as data URLs
    allowed_media_domains: Annotated[list[str], Field(max_length=MAX_MEDIA_DOMAINS)] = []
    # vLLM's --limit-mm-per-prompt: {"image": N}, the images one prompt may hold (0: none, for a
    # vision-language model served for text); {}: up to MAX_IMAGES
    limit_mm_per_prompt: dict[str, int] = {}
    # vLLM's --mm-processor-kwargs: more arguments of the model processor's call for a chat's
    # images (Qwen2-VL's and Qwen3-VL's {"size": {"shortest_edge": ..., "longest_edge": ...}},
    # a bound on an image's pixels, so on its tokens); {}: the processor as configured
    mm_processor_kwargs: dict[str, Any] = {}
    # vLLM's POST /pause and /resume and GET /is_paused on the HTTP front (router/pause.py): every
    # new request held at the router while a trainer updates weights; off (404), since any client
    # with a key could stop the service
    pause_endpoints: bool = False
    # SGLang's POST /update_weights_from_disk (router/weights.py): every worker of both pools
    # loads a checkpoint from a path on its host, the router paused meanwhile; off (404), since a
    # client with a key could load any checkpoint the workers can read
    weight_updates: bool = False
    # vLLM's sleep mode (--enable-sleep-mode): POST /sleep and /wake_up and GET /is_sleeping on
    # the HTTP front (router/sleep.py): every worker's engine frees its KV cache (and, at level
    # 2, its weights) while a trainer shares the machines; off (404), since any client with a
    # key could put the service to sleep
    sleep_mode: bool = False
    # client API keys (any one of them lets a client in, on gRPC and HTTP); unset: open
    api_keys: Annotated[list[SecretStr], Field(min_length=1, max_length=MAX_API_KEYS)] | None = None
    api_keys_file: KeysFile | None = None
    # the metrics scrape's keys (a file, one a line): with it, GET /metrics takes one of these and
    # no client key, so a Prometheus scrape config never carries a client API key
    metrics_keys_file: KeysFile | None = None

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data):
        # the health keys before worker_silence_s: refused by name, so an old file says what to set
        for old, new in RETIRED_ROUTER_KEYS.items():
            if isinstance(data, dict) and old in data:
                raise ValueError(f"{old} is retired: {new}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _free_http_port_with_a_free_port(cls, data):
        # a free gRPC port asked for (tests, side-by-side deployments): a free HTTP port too,
        # not the fixed default that a second such deployment would collide on
        if isinstance(data, dict) and data.get("port") == 0 and "http_port" not in data:
            data = {**data, "http_port": 0}
        return data

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v):
        for i, key in enumerate(v or ()):
            check_api_key(key.get_secret_value(), f"API key #{i + 1}")
        return v

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, v):
        return [check_origin(origin, len(v)) for origin in v]

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_domains(cls, v):
        return [check_media_domain(domain) for domain in v]

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _image_limit(cls, v):
        image_limit(v)
        return v

    _processor_kwargs = field_validator("mm_processor_kwargs")(
        classmethod(lambda cls, v: mm_processor_kwargs(v, "router.mm_processor_kwargs"))
    )

    def max_images(self) -> int:
        """The images one prompt may hold (limit_mm_per_prompt's image)."""
        return image_limit(self.limit_mm_per_prompt or None)

    @field_validator("api_keys_file", "metrics_keys_file")
    @classmethod
    def _keys_file(cls, v):
        if v is not None:
            try:
                parse_api_keys(v.data.decode("utf-8"), v.path)
            except UnicodeDecodeError:
                raise ValueError(f"{v.path} must hold the keys as UTF-8 text") from None
        return v

    @model_validator(mode="after")
    def _health_bounds(self):
        if self.worker_down_s > self.worker_silence_s:
            raise ValueError(
                f"worker_down_s ({self.worker_down_s:g}) must not exceed worker_silence_s "
                f"({self.worker_silence_s:g}): a worker is skipped for new work before it is "
                f"declared dead"
            )
        return self

    @model_validator(mode="after")
    def _ports(self):
        if self.api_keys is not None and self.api_keys_file is not None:
            raise ValueError("set api_keys or api_keys_file, not both")
        both = set(self.metrics_keys()) & set(self.client_keys({})[0])
        if both:
            raise ValueError(
                f"metrics_keys_file: {len(both)} of its keys are client API keys too; give the "
                f"metrics scrape keys of their own"
            )
        if self.http_port is not None and self.http_port and self.http_port == self.port:
            raise ValueError(f"{PORT_CLASH} {self.port}: the HTTP and gRPC fronts need a port each")
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def metrics_keys(self) -> tuple[str, ...]:
        """The keys GET /metrics takes instead of the client keys (metrics_keys_file); () when
        unset, and then /metrics takes what the client API takes. Never logged."""
        f = self.metrics_keys_file
        return parse_api_keys(f.data.decode(), f.path) if f is not None else ()

    def client_keys(self, environ=os.environ) -> tuple[tuple[str, ...], str]:
        """(the client API keys, which setting gave them); ((), "") when none did, and then the
        client API is open. The first found wins, as for the secret: api_keys_file (one key per
        line), api_keys, then the environment's PDSERVE_API_KEYS (comma-separated). Keys are never
        shown in an error, a dump or a log line."""
        if self.api_keys_file is not None:
            f = self.api_keys_file
            return parse_api_keys(f.data.decode(), f.path), f"router.api_keys_file ({f.path})"
        if self.api_keys is not None:
            return tuple(k.get_secret_value() for k in self.api_keys), "router.api_keys"
        value = environ.get(API_KEYS_ENV, "").strip()
        if value:
            return parse_api_keys(value, API_KEYS_ENV), API_KEYS_ENV
        return (), ""


# the modules NIXL's PyPI packages install (nixl picks nixl-cu12 or nixl-cu13)
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


def nixl_installed() -> bool:
    """Whether a NIXL Python package is importable here (found, not imported: cheap)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


class KVTransferSettings(_Frozen):
    # auto: each decode worker serves grpc and, when its KV pool is in host memory, shm (and nixl
    # or torch where installed and `profile` ranks them first); each prefill worker pushes over
    # the fastest that applies: by default shm to a decode worker on its machine, grpc to the
    # others (kvtransfer/choose.py). nixl: one-sided NIXL WRITEs into the decode worker's KV pool
    # (the `nixl` extra). cuda_ipc: the decode worker's CUDA pool opened by a prefill worker on
    # the same GPU, written device to device (auto offers it first when the pool is on a GPU)
    backend: Literal["auto", "grpc", "shm", "torch", "nixl", "cuda_ipc"] = "auto"
    # auto only: a `pdserve profile` JSON whose measured hand-off figures rank the backends (read
    # once, here, when the config is loaded; relative to the YAML's folder); null: the built-in
    # ranking (shm on one machine, grpc between)
    profile: ProfileFile | None = None

    @field_validator("profile")
    @classmethod
    def _profile_ranks(cls, value):
        if value is not None:
            from pdserve.kvtransfer.backends import BACKENDS
            from pdserve.kvtransfer.choose import ranking_from_profile

            try:
                ranking_from_profile(json.loads(value.data), value.path, BACKENDS)
            except ValueError as e:  # JSON or ranking
                raise ValueError(
                    f"{value.path}: not a profile that ranks KV backends: {e}"
                ) from None
        return value

    @model_validator(mode="after")
    def _profile_on_auto(self):
        if self.profile is not None and self.backend != "auto":
            raise ValueError(
                f"profile ranks the backends of backend: auto; with backend: {self.backend} "
                f"remove it (or set backend: auto)"
            )
        return self

    def ranking(self):
        """The ranking auto serves and offers by (kvtransfer/choose.py Ranking), of every backend:
        each decode worker leaves out those not installed on its machine."""
        from pdserve.kvtransfer.backends import BACKENDS
        from pdserve.kvtransfer.choose import DEFAULT, ranking_from_profile

        if self.profile is None:
            return DEFAULT
        return ranking_from_profile(json.loads(self.profile.data), self.profile.path, BACKENDS)

    @field_validator("backend")
    @classmethod
    def _nixl_installed(cls, value: str) -> str:
        if value == "nixl" and not nixl_installed():
            raise ValueError(
                "kvtransfer.backend 'nixl' needs NIXL, which is not installed: install the "
                "extra (pip install 'pdserve[nixl]', or pip install nixl-cu12) on every "
                "machine of the deployment, or choose grpc, shm or torch"
            )
        return value


class RaySettings(_Frozen):
    address: str | None = None  # None: start a local Ray for this deployment
    num_cpus: Annotated[int, Field(ge=1)] | None = None  # local Ray only; None: all cores
    temp_dir: str | None = None  # local Ray only; None: <pdserve cache dir>/ray
    # local Ray only: Ray's dashboard (http://127.0.0.1:<dashboard_port>; None: Ray's 8265, or
    # the next free one). Off by default: it costs a process and its memory
    dashboard: bool = False
    dashboard_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    # local Ray only: where its ports (GCS, raylet, object manager, workers, agents, metrics,
    # autoscaler metrics, dashboard) and the workers' own listen. loopback: 127.0.0.1 only, so
    # nothing of the deployment but the router's ports (router.host) can be reached from another
    # machine; all: Ray's own choice, the machine's address on every interface, for a cluster
    # that other nodes join (`ray start --address`). A cluster joined by ray.address listens
    # where its `ray start` put it (a node of a multi-node cluster cannot be loopback-only).
    bind: Literal["loopback", "all"] = "loopback"

    @model_validator(mode="after")
    def _dashboard_local_only(self):
        if self.bind == "all" and self.address is not None:
            raise ValueError(
                "bind: only for the local Ray pdserve starts; the nodes of a cluster joined by "
                "ray.address listen where their `ray start --node-ip-address` put them"
            )
        if self.dashboard and self.address is not None:
            raise ValueError(
                "dashboard: only for the local Ray pdserve starts; a cluster joined by "
                "ray.address has its own (`ray start --head` starts it, port 8265)"
            )
        if self.dashboard_port is not None and not self.dashboard:
            raise ValueError("dashboard_port: set dashboard: true too, or remove dashboard_port")
        return self


class PlannerSettings(_Frozen):
    """`planner:` (planner/policy.py): moves the prefill:decode split while traffic shifts, by
    role flips and local prefill, to keep the SLO (p90 TTFT and TPOT). Off unless enabled."""

    enabled: bool = False
    ttft_s: Annotated[float, Field(gt=0)] = 1.0
    tpot_s: Annotated[float, Field(gt=0)] = 0.1
    interval_s: Annotated[float, Field(gt=0)] = 5.0
    window_s: Annotated[float, Field(gt=0)] = 15.0
    margin: Annotated[float, Field(ge=0, lt=1)] = 0.2
    sustain: Annotated[int, Field(ge=1)] = 2
    cooldown_s: Annotated[float, Field(ge=0)] = 30.0
    max_flips_per_min: Annotated[int, Field(ge=0)] = 8
    kv_high: Annotated[float, Field(gt=0, le=1)] = 0.9
    local_step: Annotated[int, Field(ge=0)] = 64
    local_cap: Annotated[int, Field(ge=0)] = 1024  # 0: the planner never prefills locally
    prefill_use: Annotated[float, Field(gt=0, le=1)] = 0.95  # sizes a batch of flips


class LoRASettings(_Frozen):
    """`lora:` LoRA adapters in PEFT's format (engine/lora.py; vLLM's --enable-lora,
    --lora-modules, --max-loras, --max-lora-rank). Every worker of both pools loads `modules`
    ({name: adapter directory}, on every worker's host) at start; a request names an adapter
    as its `model`. max_loras: adapters one engine step runs (engine/scheduler.py: a further
    adapter's requests wait, first come first served) and whose weights a worker holds at once
    (the least recently used evicted, read again from disk when needed); max_lora_rank: the largest rank
    r an adapter may have (a larger one is refused at load). allow_runtime_updates: the
    router's /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 404)."""

    enabled: bool = False
    modules: dict[str, Annotated[str, Field(min_length=1, max_length=4096)]] = {}
    max_loras: Annotated[int, Field(ge=1, le=1024)] = 1
    max_lora_rank: Annotated[int, Field(ge=1, le=1024)] = 16
    allow_runtime_updates: bool = False

    @field_validator("modules")
    @classmethod
    def _names(cls, v):
        from pdserve.engine.lora import LoRAError, check_name

        for name in v:
            try:
                check_name(name)
            except LoRAError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _needs_enabled(self):
        if not self.enabled and (self.modules or self.allow_runtime_updates):
            raise ValueError(
                "lora.modules and lora.allow_runtime_updates need lora.enabled: true "
                "(--enable-lora)"
            )
        return self


class ObservabilitySettings(_Frozen):
    """`observability:` what `pdserve up` shows its operator. log_level: the pdserve loggers'
    level on the console (unset: PDSERVE_LOG_LEVEL, else info); log_format: text lines, or one
    JSON object a line for log shippers; stats_interval_s: the router's lines per pool every this
    many seconds (router/console.py; 0: none); capture_trace: live traffic recorded as a
    replayable trace (router/capture.py); otlp_traces_endpoint: one OpenTelemetry trace per
    request across every process (protos/tracing.py)."""

    log_level: Literal["debug", "info", "warning", "error"] | None = None
    log_format: Literal["text", "json"] = "text"
    stats_interval_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 10.0
    # every finished request appended to this file as a Mooncake-format trace line
    # (router/capture.py), replayable by `pdserve bench --trace` and `pdserve tune --workload`;
    # rotated to FILE.1 past capture_max_mb
    capture_trace: str | None = None
    capture_max_mb: Annotated[int, Field(ge=1)] = 256
    # OpenTelemetry (protos/tracing.py; the otel extra): every process's spans to this OTLP
    # endpoint (unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off), new traces sampled at
    # trace_sample_ratio (a client's traceparent decides for its own)
    otlp_traces_endpoint: Annotated[str, Field(min_length=1)] | None = None
    trace_sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0


class HFOverrides(_Frozen):
    """vLLM's --hf-overrides keys that pdserve serves (any other key is refused naming it: the
    model's config is read as it is)."""

    # a generative model served as a classifier and reranker: the tokens whose logits at a
    # prompt's last position are its labels, e.g. ["no", "yes"] for Qwen3-Reranker (/v1/score and
    # /v1/rerank score the last label; engine/score_head.py)
    classifier_from_token: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=64)]],
            Field(min_length=1, max_length=64),
        ]
        | None
    ) = None
    # vLLM's recipe for Qwen3-Reranker names these beside the tokens; pdserve needs neither (it
    # reads the head from the tokens), and takes them so that the recipe runs as it is
    architectures: Annotated[list[str], Field(max_length=1)] | None = None
    is_original_qwen3_reranker: bool | None = None
    # a Matryoshka embedding model (Qwen3-Embedding, whose config does not say so): embeddings
    # may be cut to `dimensions` (any, or one of matryoshka_dimensions) and normalised again
    is_matryoshka: bool | None = None
    matryoshka_dimensions: (
        Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=64)] | None
    ) = None


MAX_SERVED_NAMES = 64  # served_model_name's, the id included


def _served_names(value):
    """served_model_name: one name or a list of them, each 1 to 256 characters (checked here
    rather than as a union of types, whose refusal would be two lines, one per type)."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        raise ValueError("must be a name or a list of names")
    if len(names) > MAX_SERVED_NAMES:
        raise ValueError(f"at most {MAX_SERVED_NAMES} names, got {len(names)}")
    for name in names:
        if not isinstance(name, str) or not 1 <= len(name) <= 256:
            raise ValueError("each name must be text of 1 to 256 characters")
    return value


class DeployConfig(_Frozen):
    # a directory, a .gguf file, "smollm2", or a Hugging Face Hub id ORG/NAME[@REVISION]
    model: Annotated[str, Field(min_length=1)] = "smollm2"
    # the id clients name the model by (OpenAI's `model`, ListModels), or a list: the id, then
    # aliases requests may name it by too (vLLM's several --served-model-name); see
    # served_model_id and served_model_aliases
    served_model_name: Annotated[str | list[str] | None, PlainValidator(_served_names)] = None
    # vLLM's --chat-template: the Jinja chat template the router renders chats with instead of
    # the tokenizer's, given as a file (relative to the YAML's folder) or as the template itself;
    # read and parsed when the config loads (files.py chat_template_text)
    chat_template: ChatTemplate | None = None
    # vLLM's --hf-overrides, the keys pdserve serves (HFOverrides)
    hf_overrides: HFOverrides = HFOverrides()
    dtype: Literal[DTYPES] = "auto"
    # CPU pools: None, "int8", "int4" or "auto" (engine/config.py); dtype "auto" on a CPU already
    # means quantization "auto"
    quantization: Literal[QUANTIZATIONS] = None
    # "auto": the activations' dtype, or bfloat16 where dtype "auto" on a CPU passes the probe
    # with it (engine/kv_dtype.py)
    kv_cache_dtype: Literal[DTYPES] = "auto"
    # vLLM's --seed: every engine's random seed (engine/config.py), from which sampling without a
    # request's own seed draws
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0
    # vLLM's --generation-config: "auto" (the model's generation_config.json: its end-of-sequence
    # ids end sequences, its sampling fields are every request's defaults), "vllm" (its sampling
    # fields ignored) or a folder holding a generation_config.json (engine/loader/
    # generation_config.py)
    generation_config: Annotated[str, Field(min_length=1, max_length=4096)] = "auto"
    # vLLM's --override-generation-config: sampling defaults laid over generation_config's, or
    # set alone under "vllm" ({"temperature": 0.5}; generation_config.json's field names)
    override_generation_config: dict = {}
    pools: Pools = Pools()
    router: RouterSettings = RouterSettings()
    kvtransfer: KVTransferSettings = KVTransferSettings()
    ray: RaySettings = RaySettings()
    security: SecuritySettings = SecuritySettings()
    planner: PlannerSettings = PlannerSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    lora: LoRASettings = LoRASettings()

    @field_validator("override_generation_config")
    @classmethod
    def _override(cls, v):
        check_override(v)
        return v

    @model_validator(mode="after")
    def _served_names_distinct(self):
        names = self.served_model_name
        if isinstance(names, list):
            twice = sorted({n for i, n in enumerate(names) if n in names[:i]})
            if twice:
                raise ValueError(f"served_model_name names {twice} more than once")
            clash = sorted(set(names) & set(self.lora.modules))
            if clash:
                raise ValueError(
                    f"served_model_name and lora.modules both name {clash}: a request naming "
                    "it would run either the base model or the adapter"
                )
        return self

    @model_validator(mode="after")
    def _planner_needs_two_pools(self):
        if self.planner.enabled and self.pools.colocated is not None:
            raise ValueError(
                "planner.enabled needs prefill and decode pools: a colocated deployment has no "
                "split to move"
            )
        return self

    def served_model_id(self) -> str | None:
        """served_model_name (its first name); else, for a Hub id with no local path of that
        name, its ORG/NAME (as vLLM serves it; without the @REVISION); else None: the router's
        default, the model directory's or file's name."""
        if isinstance(self.served_model_name, list):
            return self.served_model_name[0]
        if self.served_model_name is not None:
            return self.served_model_name
        from pdserve.engine.loader.hub import parse_hub_id

        if pathlib.Path(self.model).expanduser().exists():
            return None
        hub_id = parse_hub_id(self.model)
        return hub_id[0] if hub_id else None

    def served_model_aliases(self) -> tuple[str, ...]:
        """The names after the first of a served_model_name list: requests naming one run the
        base model, as naming its id does; ListModels has a card for each."""
        names = self.served_model_name
        return tuple(names[1:]) if isinstance(names, list) else ()

    def worker_pools(self) -> list[tuple[str, Pool]]:
        """(key under `pools`, Pool) in start order: decode before prefill, so prefill has
        somewhere to push KV; a colocated deployment has its one pool."""
        if self.pools.colocated is not None:
            return [("colocated", self.pools.colocated)]
        return [("decode", self.pools.decode), ("prefill", self.pools.prefill)]

    def engine_kwargs(self, pool: Pool) -> dict:
        """`LLM(model, **kwargs)` for one worker of `pool`."""
        kwargs = dict(
            dtype=self.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            tensor_parallel_size=pool.tp,
            pipeline_parallel_size=pool.pp,
            block_size=pool.block_size,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            prefill_step_target_s=pool.prefill_step_target_s,
            max_num_seqs=pool.max_num_seqs,
            enable_prefix_caching=pool.enable_prefix_caching,
            seed=self.seed,
            generation_config=self.generation_config,
        )
        if pool.kv_cache_memory is not None:
            kwargs["kv_cache_memory"] = pool.kv_cache_memory
        if pool.kv_host_tier_bytes:
            kwargs["kv_host_tier_bytes"] = pool.kv_host_tier_bytes
        if pool.kv_disk_tier_bytes:
            kwargs["kv_disk_tier_bytes"] = pool.kv_disk_tier_bytes
            if pool.kv_disk_tier_dir is not None:
                kwargs["kv_disk_tier_dir"] = pool.kv_disk_tier_dir
        if pool is self.pools.decode and self.pools.colocated is None:
            # a local prefill beside running streams runs in chunks (planner/local_prefill.py)
            kwargs["max_step_slowdown"] = self.router.local_prefill.max_step_slowdown
        if pool.max_model_len is not None:
            kwargs["max_model_len"] = pool.max_model_len
        spec = pool.speculative_config
        head = self.pools.decode.speculative_config
        if (
            pool is self.pools.prefill
            and isinstance(head, dict)
            and head.get("method") in HEAD_METHODS
            and pool.pp == 1
        ):
            # the decode pool's EAGLE head (or MTP layer) runs over each prompt here, and its
            # KV goes with the hand-off (engine/spec/eagle.py; a head runs in one stage: a staged
            # prefill pool sends none, and the decode side's head starts without the prompt)
            spec = head
        kwargs["speculative_config"] = dict(spec) if isinstance(spec, dict) else spec
        if self.hf_overrides.classifier_from_token:
            kwargs["classifier_from_token"] = tuple(self.hf_overrides.classifier_from_token)
        if self.lora.enabled:  # every worker of every pool: the adapters come from its config
            kwargs.update(
                enable_lora=True,
                lora_modules=dict(self.lora.modules),
                max_loras=self.lora.max_loras,
                max_lora_rank=self.lora.max_lora_rank,
            )
        return kwargs
