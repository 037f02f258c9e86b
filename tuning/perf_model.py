"""A hardware profile as the simulator uses it: step-latency models per TP degree, the KV a replica
holds, and KV transfer per backend, loaded and checked from the JSON that `pdserve profile` writes.

`pdserve profile` (tuning/profiler.py) fits the models with `fit_nonnegative` and writes the file
with `profile_dict`. `load_profile` reads it back once per `pdserve tune` run or simulation and
returns a frozen Profile, which the simulator and the tuner only read. A profile may also carry
serving-path step models per worker kind ("serving"), fitted through a running deployment by the
SLO experiments; they include the costs of serving that a bare engine step lacks, and the
simulator uses them wherever they are given. StepModel says what the models compute, and
`profile_from_dict` lists the keys of the JSON that are read.

The profile also carries what pipeline stages and nodes cost (`Profile.placed_step_model`): how
many devices a node holds, the link between nodes (which a tensor-parallel group spanning nodes
pays per all-reduce, and a stage hand-off between nodes pays once), and the memory figures that
say how much KV a worker of tp x pp ranks holds (`Profile.kv_capacity`). Old profiles without
these keys load with the documented defaults: every device on one node, so nothing changes.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.deploy.config.files import read_text

SCHEMA = "pdserve-profile/1"
PREFILL_FORM = "a + b*T + c*A; T = tokens in the step, A = sum over prompts of n*(start+n)"
DECODE_FORM = "a + b*B + c*C; B = sequences, C = sum of their context tokens"
SERVING_KINDS = ("prefill", "decode", "colocated")
INTERFERENCE_KEYS = ("decode_while_prefill", "prefill_while_decode", "colocated_while_busy")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class StepModel:
    """One TP degree: the two fitted step models (seconds) and the KV a replica holds.

    prefill is a + b*T + c*A, with T the tokens computed in the step and A the attention pairs
    (the sum over prefill chunks of n*(start + n)); decode is a + b*B + c*C, with B sequences of
    one token each and C their context tokens. A step that holds prefill chunks and decode tokens
    together (chunked prefill in a colocated worker) costs the prefill model over all its tokens
    plus the decode model's c times the decode contexts: linears cost the same per token either
    way, and decode attention reads KV as a decode step does."""

    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]
    kv_capacity_tokens: int
    # serving only: what each request's first token takes outside the worker's steps (RPC hops,
    # the router, streaming it back); it delays that request's TTFT but occupies no step
    first_token_latency_s: float = 0.0
    # serving only: measured step time / model step time, as equally likely values (quantiles of
    # the fit's residuals); the simulator draws one per step when given a seed
    step_noise: tuple[float, ...] = ()
    # serving only: the same for steps with prompt tokens (prefill and mixed steps), when the
    # calibration gave them apart: long steps average out the jitter that short decode steps show
    prompt_step_noise: tuple[float, ...] = ()
    # serving only: how the step speed moved over time, one trace per calibrated worker: the mean
    # measured / modelled step time in each window of speed_window_s seconds, in time order. The
    # simulator replays one trace per worker (from a random point) so that slow and fast spells
    # last as long as they did; step_noise then holds what is left within a window
    speed_window_s: float = 0.0
    speed_traces: tuple[tuple[float, ...], ...] = ()

    def prefill_time(self, num_tokens: int, pairs: float, decode_context: float = 0.0) -> float:
        a, b, c = self.prefill
        return a + b * num_tokens + c * pairs + self.decode[2] * decode_context

    def decode_time(self, num_seqs: int, context: float) -> float:
        a, b, c = self.decode
        return a + b * num_seqs + c * context


@dataclass(frozen=True)
class TransferModel:
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


# the link between nodes when a profile does not give one (hardware.inter_node): 100 Gb/s
# Ethernet's 12.5 GB/s and 20 us a call, a plain data-centre network
DEFAULT_INTER_NODE = TransferModel(12.5e9, 20e-6)
ACTIVATION_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class PlacedCosts:
    """What a worker's placement adds to each step of the profiled tp model, in seconds:
    all-reduces over the inter-node link (2 a layer, when the TP group spans nodes; a ring moves
    2 (tp-1)/tp of each token's activations) and stage hand-offs (pp - 1 hand-offs of the hidden
    states and the residual, then the final hidden states back to the first stage, each over
    the inter-node link when the two stages sit on different nodes, else the intra-node one).
    `node_crossings`: hand-offs from one stage to the next that cross nodes."""

    allreduce_fixed_s: float = 0.0
    allreduce_per_token_s: float = 0.0
    handoff_fixed_s: float = 0.0
    handoff_per_token_s: float = 0.0
    node_crossings: int = 0

    @property
    def fixed_s(self) -> float:
        return self.allreduce_fixed_s + self.handoff_fixed_s

    @property
    def per_token_s(self) -> float:
        return self.allreduce_per_token_s + self.handoff_per_token_s

    def allreduce_s(self, tokens: int) -> float:
        return self.allreduce_fixed_s + tokens * self.allreduce_per_token_s

    def handoff_s(self, tokens: int) -> float:
        return self.handoff_fixed_s + tokens * self.handoff_per_token_s


@dataclass(frozen=True)
class Profile:
    model_id: str
    model_name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    kv_bytes_per_token: int
    block_size: int
    device: str  # "cpu" (a device is a core) or "gpu"
    tp: dict[int, StepModel]
    transfer: dict[str, TransferModel]
    derived: bool = False
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    # worker kind -> TP degree -> StepModel fitted through a running deployment (isolated
    # requests for prefill, concurrent batches for decode: experiments/calibration.py). It times
    # a step beside the worker's gRPC threads, KV pushes or receives and token streaming, which a
    # bare engine.step() does not see; the simulator uses it in place of `tp`'s where given.
    serving: dict[str, dict[int, StepModel]] = field(default_factory=dict)
    # slowdowns between the workers of one host (serving.interference): "decode_while_prefill"
    # (a decode step that starts while a prefill worker computes and streams KV takes 1 + x times
    # as long), "prefill_while_decode" (the other way round) and "colocated_while_busy" (a
    # colocated worker's step that starts while another colocated worker computes); absent: 0.
    # On a CPU host the workers share cores and memory bandwidth, and a prefill worker's KV
    # pushes land in the decode worker's process while it decodes.
    interference: dict[str, float] = field(default_factory=dict)
    # the model's hidden size (model.hidden_size; absent: num_heads x head_dim, the head size
    # from kv_bytes_per_token) and its activations' bytes per element: a stage hand-off moves
    # tokens x hidden_size x this many bytes per tensor
    hidden_size: int = 0
    activation_bytes: int = 2
    # devices one node holds (hardware.devices_per_node; None: every device is on one node, so no
    # TP group and no stage hand-off ever crosses a node)
    devices_per_node: int | None = None
    # the link between nodes (hardware.inter_node): the bandwidth one all-reduce ring across nodes
    # gets (its bus bandwidth) and its latency per call, also what a stage hand-off between two
    # nodes gets; the link between the stages on one node (hardware.intra_node; absent: the
    # fastest KV transfer backend, a copy between two processes of one host)
    inter_node: TransferModel = field(default_factory=lambda: DEFAULT_INTER_NODE)
    intra_node: TransferModel | None = None
    # model.weight_bytes and hardware.usable_memory_bytes_per_device (what one device holds for
    # weights and KV): with both, a worker of tp x pp ranks holds (tp*pp*usable - weights) /
    # kv_bytes_per_token tokens of KV; without, pp times the tp entry's kv_capacity_tokens (each
    # stage rank keeps a rank's KV budget for 1/pp of the layers)
    weight_bytes: float = 0.0
    usable_memory_bytes_per_device: float | None = None

    def step_model(self, tp: int, kind: str | None = None) -> StepModel:
        """The step model a worker of `kind` ("prefill", "decode", "colocated"; None: the bare
        engine) runs with at this TP degree: the serving-path one when the profile has it."""
        return self.serving.get(kind or "", {}).get(tp, self.tp[tp])

    # ---- pipeline stages and nodes -------------------------------------------------------------
    def kv_capacity(self, tp: int, pp: int = 1) -> int:
        """Tokens of KV one worker of tp x pp ranks holds (0: its weights leave no room). Each
        rank holds 1/pp of the layers' weights and KV, so stages make room that one stage lacks."""
        if pp == 1:
            return self.tp[tp].kv_capacity_tokens
        if self.weight_bytes > 0 and self.usable_memory_bytes_per_device:
            free = tp * pp * self.usable_memory_bytes_per_device - self.weight_bytes
            return max(0, int(free // self.kv_bytes_per_token))
        return pp * self.tp[tp].kv_capacity_tokens

    def nodes_spanned(self, ranks: int) -> int:
        """Nodes that `ranks` devices packed from a node's first device take."""
        per = self.devices_per_node
        return 1 if per is None else max(1, -(-ranks // per))

    def stage_layers(self, pp: int) -> list[int]:
        """Layers of each stage, as the engine splits them (engine/parallel.py stage_layers: even
        ranges, the later stages taking one more layer each when pp does not divide them)."""
        base, extra = divmod(self.num_layers, pp)
        return [base + (1 if s >= pp - extra else 0) for s in range(pp)]

    def _link(self, crosses: bool) -> TransferModel:
        if crosses:
            return self.inter_node
        return self.intra_node or self.transfer[self.best_backend()]

    def pp_costs(self, tp: int, pp: int) -> PlacedCosts:
        """What stages and nodes add to the tp step model, per step: fixed seconds and seconds per
        token (see PlacedCosts)."""
        h_bytes = self.hidden_size * self.activation_bytes  # one token's activations, one tensor
        ar_fixed = ar_per_token = 0.0
        if self.nodes_spanned(tp) > 1:  # the TP group's all-reduces cross nodes: 2 a layer
            n = 2 * self.num_layers
            ar_fixed = n * self.inter_node.latency_s
            ar_per_token = n * 2 * (tp - 1) / tp * h_bytes / self.inter_node.bandwidth_bytes_per_s
        ho_fixed = ho_per_token = 0.0
        crossings = 0
        if pp > 1:
            per = self.devices_per_node
            node = (lambda s: 0) if per is None else (lambda s: s * tp // per)  # noqa: E731
            # stage s hands the hidden states and the residual (2 tensors) to stage s + 1
            for s in range(pp - 1):
                link = self._link(node(s) != node(s + 1))
                crossings += node(s) != node(s + 1)
                ho_fixed += link.latency_s
                ho_per_token += 2 * h_bytes / link.bandwidth_bytes_per_s
            # the last stage hands the final hidden states (1 tensor) back to the first
            link = self._link(node(pp - 1) != node(0))
            ho_fixed += link.latency_s
            ho_per_token += h_bytes / link.bandwidth_bytes_per_s
        return PlacedCosts(ar_fixed, ar_per_token, ho_fixed, ho_per_token, crossings)

    def placed_step_model(self, tp: int, pp: int = 1, kind: str | None = None) -> StepModel:
        """The step model of a worker of tp x pp ranks packed on nodes: the profiled tp model
        (its own all-reduces as profiled, on one node), plus the all-reduces over the inter-node
        link when the TP group spans nodes, plus the stage hand-offs. The stages take turns (the
        engine has no micro-batching), so the compute is all the layers' at that tp, one stage
        after another. The KV it holds: kv_capacity(tp, pp)."""
        base = self.step_model(tp, kind)
        c = self.pp_costs(tp, pp)
        if not (c.fixed_s or c.per_token_s) and pp == 1:
            return base
        pa, pb, pc = base.prefill
        da, db, dc = base.decode
        return replace(
            base,
            # a decode step's B tokens are all-reduced as a prefill step's T tokens are
            prefill=(pa + c.fixed_s, pb + c.per_token_s, pc),
            decode=(da + c.fixed_s, db + c.per_token_s, dc),
            kv_capacity_tokens=self.kv_capacity(tp, pp),
        )

    @property
    def has_step_variation(self) -> bool:
        """Whether a seeded simulation differs from an unseeded one: some serving model carries
        step_noise, prompt_step_noise or step_speed traces."""
        return any(
            m.step_noise or m.prompt_step_noise or m.speed_traces
            for per_tp in self.serving.values()
            for m in per_tp.values()
        )

    @property
    def tp_degrees(self) -> list[int]:
        return sorted(self.tp)

    def best_backend(self) -> str:
        return max(self.transfer, key=lambda b: (self.transfer[b].bandwidth_bytes_per_s, b))

    def matches_model(self, model: str) -> bool:
        """Whether a deployment's `model` (an alias, an id or a path) names this profile's model."""
        want = {self.model_id.lower(), self.model_name.lower()}
        name = model.rstrip("/").lower()
        return (
            name in want
            or pathlib.PurePath(name).name in want
            or pathlib.PurePath(name).stem in want
        )


def _get(data: dict, key: str, source: str, kind, where: str = ""):
    path = f"{where}.{key}" if where else key
    if not isinstance(data, dict) or key not in data:
        raise ProfileError(
            f"{source}: {path}: missing (is this a profile written by `pdserve profile`?)"
        )
    value = data[key]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind in (int, float) or kind == (int, float):
        ok = ok and math.isfinite(value)
    if not ok:
        raise ProfileError(
            f"{source}: {path}: expected {getattr(kind, '__name__', 'a number')}, got {value!r}"
        )
    return value


def _coef(entry: dict, source: str, where: str) -> tuple[float, float, float]:
    coef = _get(entry, "coef", source, list, where)
    if len(coef) != 3 or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
        for x in coef
    ):
        raise ProfileError(
            f"{source}: {where}.coef: expected three finite numbers >= 0 [a, b, c], got {coef!r}"
        )
    if coef[0] + coef[1] <= 0:
        raise ProfileError(f"{source}: {where}.coef: a step cannot take no time, got {coef!r}")
    return tuple(float(x) for x in coef)


def _multipliers(values, source: str, where: str) -> tuple[float, ...]:
    if not isinstance(values, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
        for x in values
    ):
        raise ProfileError(
            f"{source}: {where}: expected a list of step-time multipliers > 0, got {values!r}"
        )
    return tuple(float(x) for x in values)


def _step_speed(entry, source: str, where: str) -> tuple[float, tuple[tuple[float, ...], ...]]:
    if entry is None:
        return 0.0, ()

    def positive(x) -> bool:
        return (
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
        )

    if (
        not isinstance(entry, dict)
        or not positive(entry.get("window_s"))
        or not isinstance(entry.get("traces"), list)
        or not entry["traces"]
        or not all(
            isinstance(t, list) and t and all(positive(x) for x in t) for t in entry["traces"]
        )
    ):
        raise ProfileError(
            f"{source}: {where}: expected {{window_s: seconds > 0, traces: [[step-time "
            f"multipliers > 0, one per window], ...]}} with at least one non-empty trace"
        )
    return float(entry["window_s"]), tuple(tuple(float(x) for x in t) for t in entry["traces"])


def profile_from_dict(data, source: str = "<profile>") -> Profile:
    """The Profile in `data`, a parsed profile JSON (schema "pdserve-profile/1"); a ProfileError
    names `source` and the key of anything missing or malformed. The keys it reads:

      model: {id, name, num_layers, num_heads, num_kv_heads, dtype, hidden_size (optional),
          head_dim (optional), weight_bytes (optional)}
      kv_bytes_per_token, block_size, hardware: {device: "cpu"|"gpu"}, derived
      hardware (optional keys): devices_per_node, inter_node: {bandwidth_bytes_per_s,
          latency_s}, intra_node: {the same}, usable_memory_bytes_per_device
      tp: {"<degree>": {prefill: {coef: [a, b, c]}, decode: {coef: [a, b, c]}, kv_capacity_tokens}}
          (kv_capacity_tokens 0: the weights leave no room for KV in one stage at this degree)
      kv_transfer: {"<backend>": {bandwidth_bytes_per_s, latency_s}}
      serving (optional): {"prefill"|"decode"|"colocated": {"<degree>": {prefill: {coef},
          decode: {coef}, first_token_latency_s, step_noise, prompt_step_noise,
          step_speed: {window_s, traces}}}, interference: {decode_while_prefill,
          prefill_while_decode, colocated_while_busy}}

    StepModel's fields say what the serving keys mean, Profile's what the optional model and
    hardware keys mean and their defaults. The rest of the file (samples, fit errors, source) is
    for people and is kept untouched in Profile.raw."""
    if not isinstance(data, dict):
        raise ProfileError(
            f"{source}: the top level must be a JSON object, got {type(data).__name__}"
        )
    schema = data.get("schema")
    if schema != SCHEMA:
        raise ProfileError(f"{source}: schema: expected {SCHEMA!r}, got {schema!r}")
    model = _get(data, "model", source, dict)
    hw = _get(data, "hardware", source, dict)
    device = _get(hw, "device", source, str, "hardware")
    if device not in ("cpu", "gpu"):
        raise ProfileError(f"{source}: hardware.device: expected 'cpu' or 'gpu', got {device!r}")
    tps = _get(data, "tp", source, dict)
    if not tps:
        raise ProfileError(f"{source}: tp: no TP degree was profiled")
    num_heads = _get(model, "num_heads", source, int, "model")
    num_kv_heads = _get(model, "num_kv_heads", source, int, "model")
    steps = _tp_steps(tps, num_heads, num_kv_heads, source)
    transfer = _transfers(data, source)
    serving, interference = _serving(data.get("serving") or {}, steps, source)
    kv_bytes = _get(data, "kv_bytes_per_token", source, int)
    block_size = _get(data, "block_size", source, int)
    if kv_bytes < 1 or block_size < 1:
        raise ProfileError(f"{source}: kv_bytes_per_token and block_size must be >= 1")
    num_layers = _get(model, "num_layers", source, int, "model")
    if num_layers < 1:
        raise ProfileError(f"{source}: model.num_layers: must be >= 1, got {num_layers}")
    dtype = str(model.get("dtype", "auto"))
    act_bytes = ACTIVATION_BYTES.get(dtype, 2 if device == "gpu" else 4)  # "auto": as the engine
    return Profile(
        model_id=_get(model, "id", source, str, "model"),
        model_name=str(model.get("name") or model["id"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        kv_bytes_per_token=kv_bytes,
        block_size=block_size,
        device=device,
        tp=steps,
        transfer=transfer,
        derived=bool(data.get("derived", False)),
        raw=data,
        serving=serving,
        interference=interference,
        hidden_size=_hidden_size(model, num_layers, num_kv_heads, kv_bytes, act_bytes, source),
        activation_bytes=act_bytes,
        **_placing(hw, model, source),
    )


def _positive(section: dict, key: str, source: str, where: str, kind=(int, float)):
    """section[key] if it is there (None if not), a finite number > 0 of `kind`."""
    value = section.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not (math.isfinite(value) and value > 0)
    ):
        what = "an integer" if kind is int else "a number"
        raise ProfileError(f"{source}: {where}.{key}: expected {what} > 0, got {value!r}")
    return value


def _hidden_size(
    model: dict, num_layers: int, num_kv_heads: int, kv_bytes: int, act_bytes: int, source: str
) -> int:
    """model.hidden_size, else num_heads x head_dim (model.head_dim, else the head size that
    kv_bytes_per_token implies: K and V of every layer's KV heads, at the activations' bytes)."""
    hidden = _positive(model, "hidden_size", source, "model", int)
    if hidden:
        return hidden
    head_dim = _positive(model, "head_dim", source, "model", int) or max(
        1, kv_bytes // (2 * num_layers * num_kv_heads * act_bytes)
    )
    return model["num_heads"] * head_dim


def _placing(hw: dict, model: dict, source: str) -> dict:
    """The optional keys that price pipeline stages and nodes (Profile's fields say what they
    mean and what their absence means)."""
    out: dict = {}
    per_node = _positive(hw, "devices_per_node", source, "hardware", int)
    if per_node:
        out["devices_per_node"] = per_node
    for key in ("inter_node", "intra_node"):
        entry = hw.get(key)
        if entry is None:
            continue
        where = f"hardware.{key}"
        if not isinstance(entry, dict):
            raise ProfileError(
                f"{source}: {where}: expected {{bandwidth_bytes_per_s, latency_s}}, got {entry!r}"
            )
        bw = _positive(entry, "bandwidth_bytes_per_s", source, where)
        lat = entry.get("latency_s", 0.0)
        if (
            bw is None
            or isinstance(lat, bool)
            or not isinstance(lat, (int, float))
            or not (math.isfinite(lat) and lat >= 0)
        ):
            raise ProfileError(
                f"{source}: {where}: bandwidth_bytes_per_s must be > 0 and latency_s >= 0"
            )
        out[key] = TransferModel(float(bw), float(lat))
    weights = _positive(model, "weight_bytes", source, "model")
    usable = _positive(hw, "usable_memory_bytes_per_device", source, "hardware")
    if weights:
        out["weight_bytes"] = float(weights)
    if usable:
        out["usable_memory_bytes_per_device"] = float(usable)
    return out


def _tp_steps(tps: dict, num_heads: int, num_kv_heads: int, source: str) -> dict[int, StepModel]:
    """tp: the engine's step models and KV capacity per TP degree."""
    steps = {}
    for key, entry in tps.items():
        where = f"tp.{key}"
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
            raise ProfileError(f'{source}: {where}: TP degrees are keys like "1", got {key!r}')
        # (one KV head: an MLA model's latent, which every rank holds)
        if num_heads % int(key) or (num_kv_heads % int(key) and num_kv_heads != 1):
            raise ProfileError(
                f"{source}: {where}: {key} does not divide the model's {num_heads} heads "
                f"and {num_kv_heads} KV heads"
            )
        capacity = _get(entry, "kv_capacity_tokens", source, int, where)
        if capacity < 0:
            raise ProfileError(
                f"{source}: {where}.kv_capacity_tokens: must be >= 0 (0: the weights leave no "
                f"room for KV at this degree in one stage), got {capacity}"
            )
        steps[int(key)] = StepModel(
            _coef(_get(entry, "prefill", source, dict, where), source, f"{where}.prefill"),
            _coef(_get(entry, "decode", source, dict, where), source, f"{where}.decode"),
            capacity,
        )
    return steps


def _transfers(data: dict, source: str) -> dict[str, TransferModel]:
    """kv_transfer: each backend's bandwidth and per-message latency."""
    transfer = {}
    for backend, entry in _get(data, "kv_transfer", source, dict).items():
        where = f"kv_transfer.{backend}"
        bw = _get(entry, "bandwidth_bytes_per_s", source, (int, float), where)
        lat = _get(entry, "latency_s", source, (int, float), where) if "latency_s" in entry else 0.0
        if bw <= 0 or lat < 0:
            raise ProfileError(f"{source}: {where}: bandwidth must be > 0 and latency >= 0")
        transfer[backend] = TransferModel(float(bw), float(lat))
    if not transfer:
        raise ProfileError(f"{source}: kv_transfer: no backend was measured")
    return transfer


def _serving(
    section: dict, steps: dict[int, StepModel], source: str
) -> tuple[dict[str, dict[int, StepModel]], dict[str, float]]:
    """serving: the step models measured through the serving path, per worker kind and TP
    degree, and the interference factors."""
    serving: dict[str, dict[int, StepModel]] = {}
    interference: dict[str, float] = {}
    for kind, per_tp in section.items():
        if kind == "source":
            continue
        if kind == "interference":
            interference.update(_interference(per_tp or {}, source))
            continue
        if kind not in SERVING_KINDS or not isinstance(per_tp, dict):
            raise ProfileError(
                f"{source}: serving.{kind}: expected one of {SERVING_KINDS} mapping "
                f"TP degrees to {{prefill: {{coef}}, decode: {{coef}}}}"
            )
        for key, entry in per_tp.items():
            where = f"serving.{kind}.{key}"
            if not (isinstance(key, str) and key.isdigit() and int(key) in steps):
                raise ProfileError(
                    f"{source}: {where}: not a TP degree of this profile ({sorted(steps)})"
                )
            serving.setdefault(kind, {})[int(key)] = _serving_step(
                entry, steps[int(key)], source, where
            )
    return serving, interference


def _interference(section: dict, source: str) -> dict[str, float]:
    interference = {}
    for key, value in section.items():
        if (
            key not in INTERFERENCE_KEYS
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ProfileError(
                f"{source}: serving.interference.{key}: expected one of "
                f"{INTERFERENCE_KEYS} with a number >= 0, got {value!r}"
            )
        interference[key] = float(value)
    return interference


def _serving_step(entry, base: StepModel, source: str, where: str) -> StepModel:
    """One serving-path step model; what it does not give is the engine's (`base`)."""
    if not isinstance(entry, dict):
        raise ProfileError(f"{source}: {where}: expected {{prefill: {{coef}}, decode: {{coef}}}}")
    pf = _coef(entry["prefill"], source, f"{where}.prefill") if "prefill" in entry else base.prefill
    dc = _coef(entry["decode"], source, f"{where}.decode") if "decode" in entry else base.decode
    latency = entry.get("first_token_latency_s", 0.0)
    if (
        isinstance(latency, bool)
        or not isinstance(latency, (int, float))
        or not (math.isfinite(latency) and latency >= 0)
    ):
        raise ProfileError(
            f"{source}: {where}.first_token_latency_s: expected seconds >= 0, got {latency!r}"
        )
    noise = {
        k: _multipliers(entry.get(k, []), source, f"{where}.{k}")
        for k in ("step_noise", "prompt_step_noise")
    }
    window, traces = _step_speed(entry.get("step_speed"), source, f"{where}.step_speed")
    return StepModel(
        pf,
        dc,
        base.kv_capacity_tokens,
        float(latency),
        noise["step_noise"],
        noise["prompt_step_noise"],
        window,
        traces,
    )


def load_profile(path: str | pathlib.Path) -> Profile:
    name = str(path)
    text = read_text(path, ProfileError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{name}: not JSON: {e}") from None
    return profile_from_dict(data, name)


# ---- fitting ------------------------------------------------------------------------------------
def fit_nonnegative(features: list[list[float]], latencies: list[float]) -> dict:
    """Least squares of latency on features (the first column is 1s), weighted by 1/latency so
    small steps count as much as big ones, with every coefficient >= 0 (a negative one would
    predict negative time somewhere): the best fit over the subsets of columns whose unconstrained
    fit is non-negative. Returns coef and the fit error (relative and absolute)."""
    x = np.asarray(features, dtype=float)
    y = np.asarray(latencies, dtype=float)
    if x.ndim != 2 or len(y) != len(x) or len(y) < x.shape[1]:
        raise ValueError(
            f"need at least {x.shape[1] if x.ndim == 2 else '?'} samples to fit, got {len(y)}"
        )
    w = 1.0 / np.maximum(y, 1e-9)
    best = None
    ncols = x.shape[1]
    for mask in range(1, 1 << ncols):
        cols = [j for j in range(ncols) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(ncols)
        coef[cols] = sol
        rel = (x @ coef - y) / y
        score = float(np.sum(rel**2))
        if best is None or score < best[0]:
            best = (score, coef)
    coef = best[1]
    pred = x @ coef
    rel = (pred - y) / y
    return {
        "coef": [float(c) for c in coef],
        "fit": {
            "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
            "max_rel_error": float(np.max(np.abs(rel))),
            "rmse_s": float(np.sqrt(np.mean((pred - y) ** 2))),
            "num_samples": int(len(y)),
        },
    }


def prefill_features(seq_lens: list[int], starts: list[int] | None = None) -> list[float]:
    starts = starts or [0] * len(seq_lens)
    return [1.0, float(sum(seq_lens)), float(sum(n * (s + n) for n, s in zip(seq_lens, starts)))]


def decode_features(batch_size: int, context_tokens: int) -> list[float]:
    """context_tokens: per sequence."""
    return [1.0, float(batch_size), float(batch_size * context_tokens)]


def profile_dict(
    *,
    model: dict,
    kv_bytes_per_token: int,
    hardware: dict,
    tp: dict[int, dict],
    kv_transfer: dict[str, dict],
    block_size: int = 16,
    **extra,
) -> dict:
    """A profile in the JSON schema from its parts; tp[degree] holds prefill and decode entries
    ({coef, samples, fit, ...}) and kv_capacity_tokens. Used by the profiler, the derived GPU
    profile and tests (hand-made profiles)."""
    tp_out = {}
    for degree, entry in sorted(tp.items()):
        tp_out[str(degree)] = {
            "prefill": {"form": PREFILL_FORM, **entry["prefill"]},
            "decode": {"form": DECODE_FORM, **entry["decode"]},
            "kv_capacity_tokens": int(entry["kv_capacity_tokens"]),
            **{
                k: v
                for k, v in entry.items()
                if k not in ("prefill", "decode", "kv_capacity_tokens")
            },
        }
    return {
        "schema": SCHEMA,
        **extra,
        "model": model,
        "kv_bytes_per_token": int(kv_bytes_per_token),
        "block_size": block_size,
        "hardware": hardware,
        "tp_degrees": sorted(tp),
        "tp": tp_out,
        "kv_transfer": kv_transfer,
    }
