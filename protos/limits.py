"""Bounds on what one request may ask for, checked at every RPC edge (router and workers) before
any work: sizes a stranger controls (ids, stop lists, prompts) and numbers that would make a
process loop, allocate or wait without end. Pure protobuf: no engine import, so the router can
use it (docs/architecture.md section 2). Each check returns None or a Refusal: the gRPC status and a
message that says what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

MAX_ID_CHARS = 256  # request_id, worker_id
MAX_ADDRESS_CHARS = 1024  # host:port or a KV endpoint address
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512  # per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_PREDICTION_TOKENS = 65536  # as engine/sampling_params.py
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]
MAX_CACHE_SALT_CHARS = 256  # as engine/sampling_params.py
MAX_BAD_WORDS = 128  # vLLM's bound (engine/sampling_params.py); each at most MAX_STOP_CHARS
# repetition detection's bounds (the engine's: engine/sampling_params.py MAX_REPETITION_*): the
# longest pattern, and the tokens pattern x count a step's check may read
MAX_REPETITION_PATTERN = 256
MAX_REPETITION_SPAN = 2048
MAX_N = 64  # sequences per prompt
# structured output (as engine/structured/spec.py, which the engine checks again)
MAX_SCHEMA_CHARS = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_LOGPROBS = 20  # top_logprobs / prompt_logprobs alternatives per position (vLLM's max_logprobs)
# sampling.prompt_logprobs: each of a request's n Finishes carries the prompt's logprobs, so it
# asks for n x positions x (prompt_logprobs + 1) numbers (a logprob and its alternatives at each
# prompt position after the first); at most this many (2^21, about 15 MB of Finishes on the
# wire), or what one sequence needs at the full context when that is more (check_prompt_logprobs)
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 21
# ReserveRequest.stream_interval: the most tokens a decode worker holds back before it wakes a
# request's stream (decode_worker/streams.py Interval)
MAX_STREAM_INTERVAL = 64
# UpdateWeights (worker_common/weights.py, router/weights.py): its fields, and how long one
# worker's load of a checkpoint from its disk may take
MAX_WEIGHTS_PATH_BYTES, MAX_WEIGHT_VERSION_CHARS = 4096, 256
WEIGHT_UPDATE_TIMEOUT_S = 600.0
# a trainer's weight group (engine/weight_sync.py): its name, its timeout, and one update's list
MAX_WEIGHT_GROUP_CHARS, MAX_WEIGHT_GROUP_TIMEOUT_S, MAX_WEIGHT_WORLD = 64, 3600.0, 65536
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
MAX_WEIGHT_TENSORS, MAX_WEIGHT_NAME_CHARS, MAX_WEIGHT_DIMS = 100_000, 512, 8
# sleep mode (worker_common/sleep.py, router/sleep.py): a worker's Sleep levels (level 0, which
# pauses scheduling only, is the router's alone), the tags a WakeUp may name, and how long one
# worker's sleep or wake may take (a wake after level 2 loads the weights again, as an update does)
SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")
MAX_SLEEP_TAGS = 4
SLEEP_TIMEOUT_S = WEIGHT_UPDATE_TIMEOUT_S
# a vision-language model's images (pdserve.v1.ContentPart, worker.PixelValues): a request's
# images, each image file's bytes (OpenAI's limit) and pixels (Pillow decodes no more), all the
# files of a request together, and the pixel values the router sends a worker for them
MAX_IMAGES = 16
MAX_IMAGE_FILE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 36_000_000
MAX_REQUEST_IMAGE_BYTES = 32 << 20
# (SmolVLM's largest image is 16 tiles of 512x512 and the whole image: 51 MiB of float32)
MAX_PIXEL_VALUE_BYTES = 64 << 20


def check_weight_update(model_path: str, weight_version: str) -> str | None:
    """Why UpdateWeights' fields cannot be taken, or None (the router and the workers alike)."""
    if not model_path or len(model_path.encode()) > MAX_WEIGHTS_PATH_BYTES or "\x00" in model_path:
        return f"model_path must be a non-empty path of at most {MAX_WEIGHTS_PATH_BYTES} bytes"
    if len(weight_version) > MAX_WEIGHT_VERSION_CHARS or not weight_version.isprintable():
        return f"weight_version must be printable, at most {MAX_WEIGHT_VERSION_CHARS} characters"
    return None


def check_sleep_level(level: int) -> str | None:
    """Why a worker's Sleep level cannot be taken, or None."""
    if level not in SLEEP_LEVELS:
        return f"level must be 1 or 2 (level 0 pauses the router alone); got {level}"
    return None


def check_wake_tags(tags) -> str | None:
    """Why a worker's WakeUp tags cannot be taken, or None (none: every tag)."""
    if len(tags) > MAX_SLEEP_TAGS:
        return f"at most {MAX_SLEEP_TAGS} tags; got {len(tags)}"
    for tag in tags:
        if tag not in SLEEP_TAGS:
            return f"tag {tag[:40]!r} is not one of {', '.join(SLEEP_TAGS)}"
    return None


def check_transfer_id(transfer_id: object) -> str | None:
    """Why an update's transfer_id (the id the trainer's engine/weight_sync.py `send` waits on)
    cannot be taken, or None."""
    if (
        not isinstance(transfer_id, str)
        or not 1 <= len(transfer_id) <= MAX_WEIGHT_GROUP_CHARS
        or not transfer_id.isalnum()
    ):
        return (
            f"transfer_id must be 1 to {MAX_WEIGHT_GROUP_CHARS} letters and digits: the id the "
            "trainer's pdserve.engine.weight_sync send() waits on for this update"
        )
    return None


def check_weights_group(
    group_name: str, address: str, port: int, rank_offset: int, world_size: int, timeout_s: float
) -> str | None:
    """Why a weight group's fields (InitWeightsGroup, /init_weights_update_group) cannot be taken,
    or None."""
    if not group_name or len(group_name) > MAX_WEIGHT_GROUP_CHARS or not group_name.isprintable():
        return f"group_name must be printable, 1 to {MAX_WEIGHT_GROUP_CHARS} characters"
    if not address or len(address) > MAX_ADDRESS_CHARS or not address.isprintable():
        return f"master_address must be a host name or address of at most {MAX_ADDRESS_CHARS}"
    if not 0 < port < 65536:
        return "master_port must be a port number, 1 to 65535"
    if not 2 <= world_size <= MAX_WEIGHT_WORLD or not 1 <= rank_offset < world_size:
        return (
            f"world_size must be 2 to {MAX_WEIGHT_WORLD} and rank_offset 1 or more and below it "
            "(the trainer is rank 0)"
        )
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= MAX_WEIGHT_GROUP_TIMEOUT_S):
        return f"timeout_s must be more than 0 and at most {MAX_WEIGHT_GROUP_TIMEOUT_S:g}"
    return None


def check_weight_tensors(names, dtypes, shapes) -> str | None:
    """Why a trainer's tensor list (UpdateWeightsFromGroup, the router's
    /update_weights_from_distributed) cannot be taken, or None: the engine then checks it against
    the checkpoint it serves (engine/weight_sync.py)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        return (
            f"names, dtypes and shapes must be lists of one length (got {len(names)}, "
            f"{len(dtypes)}, {len(shapes)})"
        )
    if not names or len(names) > MAX_WEIGHT_TENSORS:
        return f"from 1 to {MAX_WEIGHT_TENSORS} tensors (got {len(names)})"
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not name or len(name) > MAX_WEIGHT_NAME_CHARS:
            return f"a tensor's name must be a string of 1 to {MAX_WEIGHT_NAME_CHARS} characters"
        if dtype not in WEIGHT_DTYPES:
            return f"{name}: dtype {str(dtype)[:40]!r} is not one of {', '.join(WEIGHT_DTYPES)}"
        if (
            not isinstance(shape, list | tuple)
            or len(shape) > MAX_WEIGHT_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            return f"{name}: a shape is a list of at most {MAX_WEIGHT_DIMS} sizes, each 0 or more"
    if len(set(names)) != len(names):
        return "a tensor is named twice"
    return None


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# proto uint32 fields a client's -1 turns into 4294967295: anything above this is not a length
_UINT32_WRAPPED = 1 << 31


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str

    def abort(self, context) -> None:
        context.abort(self.code, self.message)


def invalid(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_id(name: str, value: str, required: bool = True) -> Refusal | None:
    if required and not value:
        return invalid(f"{name} must be non-empty")
    if len(value) > MAX_ID_CHARS:
        return invalid(f"{name} has {len(value)} characters; at most {MAX_ID_CHARS} are allowed")
    return None


def check_stream_interval(interval: int) -> Refusal | None:
    """ReserveRequest.stream_interval: 0 or 1 (every output) up to MAX_STREAM_INTERVAL."""
    if interval > MAX_STREAM_INTERVAL:
        return invalid(
            f"stream_interval={interval}: at most {MAX_STREAM_INTERVAL} tokens are held back "
            f"before a stream wakes (router.stream_interval)"
        )
    return None


def check_sampling(sampling, max_model_len: int, vocab_size: int) -> Refusal | None:
    """A pdserve.v1.SamplingParams against this deployment's limits (the engine checks the rest:
    ranges of temperature, top_p, penalties...)."""
    if sampling is None:
        return None
    for name in ("prompt_logprobs", "top_logprobs"):
        if sampling.HasField(name) and getattr(sampling, name) > MAX_LOGPROBS:
            return invalid(
                f"sampling.{name}={getattr(sampling, name)}: at most {MAX_LOGPROBS} most likely "
                f"tokens per position"
            )
    if sampling.top_logprobs and not sampling.logprobs:
        return invalid(
            f"sampling.top_logprobs={sampling.top_logprobs} needs sampling.logprobs=true"
        )
    if sampling.HasField("max_tokens"):
        m = sampling.max_tokens
        if m >= _UINT32_WRAPPED:
            return invalid(
                f"sampling.max_tokens={m} is not a token count (a -1 sent as uint32?): "
                f"leave it unset for the default, or give at most max_model_len="
                f"{max_model_len}"
            )
        if m > max_model_len:
            return Refusal(
                grpc.StatusCode.OUT_OF_RANGE,
                f"sampling.max_tokens={m} exceeds max_model_len={max_model_len}: lower it",
            )
    if sampling.HasField("min_tokens") and sampling.min_tokens > max_model_len:
        return Refusal(
            grpc.StatusCode.OUT_OF_RANGE,
            f"sampling.min_tokens={sampling.min_tokens} exceeds max_model_len={max_model_len}",
        )
    if sampling.HasField("n") and sampling.n < 1:
        return invalid(f"sampling.n={sampling.n}: at least 1 sequence per prompt")
    if sampling.HasField("n") and sampling.n > MAX_N:
        return invalid(f"sampling.n={sampling.n}: at most {MAX_N} sequences per prompt")
    for name in _FLOAT_FIELDS:
        if sampling.HasField(name) and not math.isfinite(getattr(sampling, name)):
            return invalid(
                f"sampling.{name} must be a finite number, got {getattr(sampling, name)}"
            )
    if len(sampling.stop) > MAX_STOP_STRINGS:
        return invalid(
            f"sampling.stop has {len(sampling.stop)} strings; at most {MAX_STOP_STRINGS} "
            f"are allowed"
        )
    longest = max(map(len, sampling.stop), default=0)
    if longest > MAX_STOP_CHARS:
        return invalid(
            f"a sampling.stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed"
        )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return invalid(
            f"sampling.stop_token_ids has {len(sampling.stop_token_ids)} ids; at most "
            f"{MAX_STOP_TOKEN_IDS} are allowed"
        )
    bad = [t for t in sampling.stop_token_ids if t >= vocab_size] if vocab_size else []
    if bad:
        return invalid(
            f"sampling.stop_token_ids must be below the vocabulary size {vocab_size}, got {bad[:3]}"
        )
    refusal = check_token_shaping(sampling, vocab_size) or check_repetition(sampling)
    if refusal is None and sampling.HasField("structured"):
        return check_structured(sampling.structured)
    return refusal


def check_token_shaping(sampling, vocab_size: int) -> Refusal | None:
    """logit_bias, allowed_token_ids, bad_words, cache_salt and prediction_token_ids: how many,
    how long, ids in the vocabulary, biases in range."""
    for name, count, most, unit in (
        ("logit_bias", len(sampling.logit_bias), MAX_LOGIT_BIAS_ENTRIES, "entries"),
        ("allowed_token_ids", len(sampling.allowed_token_ids), MAX_ALLOWED_TOKEN_IDS, "ids"),
        ("bad_words", len(sampling.bad_words), MAX_BAD_WORDS, "words"),
        ("cache_salt", len(sampling.cache_salt), MAX_CACHE_SALT_CHARS, "characters"),
        ("prediction_token_ids", len(sampling.prediction_token_ids), MAX_PREDICTION_TOKENS, "ids"),
    ):
        if count > most:
            return invalid(f"sampling.{name} has {count} {unit}; at most {most} are allowed")
    for token, bias in sampling.logit_bias.items():
        if not (math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_RANGE):
            return invalid(
                f"sampling.logit_bias[{token}]={bias}: a bias is a number in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
            )
    if any(not w or len(w) > MAX_STOP_CHARS for w in sampling.bad_words):
        return invalid(f"each sampling.bad_words word has 1 to {MAX_STOP_CHARS} characters")
    for name, ids in (
        ("logit_bias", sampling.logit_bias.keys()),
        ("allowed_token_ids", sampling.allowed_token_ids),
        ("prediction_token_ids", sampling.prediction_token_ids),
    ):
        bad = [t for t in ids if t >= vocab_size][:3] if vocab_size else []
        if bad:
            return invalid(
                f"sampling.{name} token ids must be below the vocabulary size {vocab_size}, "
                f"got {bad}"
            )
    return None


def check_repetition(sampling) -> Refusal | None:
    """Repetition detection's bounds (MAX_REPETITION_*: the engine's), before any work."""
    most = sampling.max_repetition_pattern_size
    least, count = sampling.min_repetition_pattern_size, sampling.repetition_min_count
    if most > MAX_REPETITION_PATTERN:
        return invalid(
            f"sampling.max_repetition_pattern_size={most}: at most {MAX_REPETITION_PATTERN}"
        )
    if least > most:
        return invalid(
            f"sampling.min_repetition_pattern_size={least} is more than "
            f"max_repetition_pattern_size={most}"
        )
    if most * count > MAX_REPETITION_SPAN:
        return invalid(
            f"sampling.max_repetition_pattern_size x repetition_min_count = {most} x {count}: "
            f"at most {MAX_REPETITION_SPAN} tokens"
        )
    return None


def check_structured(s) -> Refusal | None:
    """A pdserve.v1.StructuredOutput: one kind set, within the size bounds (whether a schema,
    regex or grammar compiles is the engine's check, with the same INVALID_ARGUMENT)."""
    kinds = [
        k
        for k, on in (
            ("json_schema", bool(s.json_schema)),
            ("json_object", s.json_object),
            ("regex", bool(s.regex)),
            ("choice", bool(len(s.choice))),
            ("grammar", bool(s.grammar)),
        )
        if on
    ]
    if len(kinds) != 1:
        return invalid(
            f"sampling.structured must set exactly one of json_schema, json_object, regex, "
            f"choice, grammar; got {', '.join(kinds) or 'none'}"
        )
    if len(s.grammar) > MAX_GRAMMAR_CHARS:
        return invalid(
            f"sampling.structured.grammar has {len(s.grammar)} characters; at most "
            f"{MAX_GRAMMAR_CHARS} are allowed"
        )
    if len(s.json_schema) > 4 * MAX_SCHEMA_CHARS:
        return invalid(
            f"sampling.structured.json_schema has {len(s.json_schema)} characters; at most "
            f"{MAX_SCHEMA_CHARS} (as compact JSON) are allowed"
        )
    if len(s.regex) > MAX_REGEX_CHARS:
        return invalid(
            f"sampling.structured.regex has {len(s.regex)} characters; at most "
            f"{MAX_REGEX_CHARS} are allowed"
        )
    if len(s.choice) > MAX_CHOICES:
        return invalid(
            f"sampling.structured.choice has {len(s.choice)} entries; at most {MAX_CHOICES} "
            f"are allowed"
        )
    longest = max(map(len, s.choice), default=0)
    if longest > MAX_CHOICE_CHARS:
        return invalid(
            f"a sampling.structured.choice entry has {longest} characters; at most "
            f"{MAX_CHOICE_CHARS} are allowed"
        )
    if any(not c for c in s.choice):
        return invalid("sampling.structured.choice must hold only non-empty strings")
    return None


def check_context(
    prompt_len: int, sampling, max_model_len: int, prompt_is: str = "prompt"
) -> Refusal | None:
    """A prompt of `prompt_len` tokens plus the completion `sampling` asks for, against the context
    (max_model_len), as vLLM's OpenAI server checks them: an explicit max_tokens (else an explicit
    min_tokens) that the prompt leaves no room for is refused OUT_OF_RANGE, with the numbers and
    what to lower. Each of n sequences has a context of its own, so n does not multiply the count,
    and stop strings or stop tokens only end a sequence sooner. An unset max_tokens is not refused
    here: its default ends where the context does. `prompt_is` names the input ("messages" for a
    chat). The prompt's logprobs, which n does multiply, are bounded too (check_prompt_logprobs)."""
    if sampling is None:
        return None
    refusal = check_prompt_logprobs(prompt_len, sampling, max_model_len)
    if refusal:
        return refusal
    if sampling.HasField("max_tokens"):
        completion, name = sampling.max_tokens, "max_tokens"
    elif sampling.HasField("min_tokens"):
        completion, name = sampling.min_tokens, "min_tokens"
    else:
        return None
    if prompt_len + completion <= max_model_len:
        return None
    return Refusal(
        grpc.StatusCode.OUT_OF_RANGE,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + completion} tokens ({prompt_len} in the {prompt_is}, {completion} in the "
        f"completion). Please reduce the length of the {prompt_is} or the completion: with this "
        f"{prompt_is}, {name} can be at most {max(0, max_model_len - prompt_len)} "
        f"(max_model_len={max_model_len})",
    )


def check_prompt_logprobs(prompt_len: int, sampling, max_model_len: int) -> Refusal | None:
    """sampling.prompt_logprobs k for a prompt of `prompt_len` tokens: each of the n sequences'
    Finishes returns the prompt's logprobs (pdserve.proto), n x (prompt_len - 1) positions x
    (k + 1) numbers, which is refused INVALID_ARGUMENT past MAX_PROMPT_LOGPROB_ENTRIES, or past
    what one sequence with k = MAX_LOGPROBS needs at the full context when that is more: n = 1
    always fits."""
    if sampling is None or not sampling.HasField("prompt_logprobs"):
        return None
    n = sampling.n if sampling.HasField("n") else 1
    k = sampling.prompt_logprobs
    positions = max(prompt_len - 1, 0)
    entries = n * positions * (k + 1)
    most = max(MAX_PROMPT_LOGPROB_ENTRIES, (max_model_len - 1) * (MAX_LOGPROBS + 1))
    if entries <= most:
        return None
    return invalid(
        f"sampling.prompt_logprobs={k} with sampling.n={n} and a prompt of {prompt_len} tokens "
        f"asks for {entries} prompt logprobs (each of the n sequences returns the prompt's: n x "
        f"{positions} positions x (prompt_logprobs + 1)); at most {most} are allowed: lower n "
        f"or prompt_logprobs, or shorten the prompt"
    )


def check_token_ids(name: str, ids, max_model_len: int, vocab_size: int) -> Refusal | None:
    """Prompt ids: 1 to max_model_len - 1 of them (one position left to generate into), each a
    vocabulary id. `ids` is a repeated uint32 field or a list."""
    if not len(ids):
        return invalid(f"{name} is empty: send at least one token")
    if len(ids) > max_model_len - 1:
        return Refusal(
            grpc.StatusCode.OUT_OF_RANGE,
            f"{name} has {len(ids)} tokens but max_model_len is {max_model_len}: shorten "
            f"it to at most {max_model_len - 1} tokens",
        )
    if vocab_size and max(ids) >= vocab_size:
        bad = [t for t in ids if t >= vocab_size][:3]
        return invalid(f"{name} must be ids below the vocabulary size {vocab_size}, got {bad}")
    return None


def check_pixel_values(images) -> Refusal | None:
    """A worker.PixelValues as the router sends it (unset: no images): float32 pixel values
    [images, channels, height, width] or [images, tiles, channels, height, width], or, with
    image_grid_thw, every image's patches [patches, patch values], within MAX_IMAGES and
    MAX_PIXEL_VALUE_BYTES, the data as long as the shape says, image_sizes none or a positive
    (height, width) of at most MAX_IMAGE_PIXELS an image, a pixel_attention_mask none or a byte
    a pixel of [images, tiles, height, width], each 0 or 1, and an image_grid_thw none or three
    positive numbers an image whose products count the patches."""
    shape = list(images.shape)
    grids = list(images.image_grid_thw)
    if (
        not shape
        and not images.data
        and not images.image_sizes
        and not images.pixel_attention_mask
        and not grids
    ):
        return None
    if grids:
        refusal = _check_patch_grids(shape, grids)
        if refusal is not None:
            return refusal
    elif len(shape) not in (4, 5) or min(shape) < 1:
        return invalid(
            f"images.shape must be 4 or 5 positive sizes [images, (tiles,) channels, height, "
            f"width], got {shape[:8]}"
        )
    elif shape[0] > MAX_IMAGES:
        return invalid(f"a prompt holds {shape[0]} images; at most {MAX_IMAGES} are allowed")
    size = 4 * math.prod(shape)
    if size > MAX_PIXEL_VALUE_BYTES:
        return invalid(
            f"the images' pixel values take {size} bytes; at most {MAX_PIXEL_VALUE_BYTES} are "
            f"allowed: send fewer or smaller images"
        )
    if len(images.data) != size:
        return invalid(
            f"images.data has {len(images.data)} bytes, but shape {shape} needs {size} (float32)"
        )
    sizes = list(images.image_sizes)
    if sizes and len(sizes) != 2 * shape[0]:
        return invalid(
            f"images.image_sizes must hold a height and a width for each of the {shape[0]} "
            f"images, or nothing; got {len(sizes)} numbers"
        )
    pairs = list(zip(sizes[::2], sizes[1::2]))
    if any(h < 1 or w < 1 or h * w > MAX_IMAGE_PIXELS for h, w in pairs):
        return invalid(
            f"images.image_sizes must be positive heights and widths of at most "
            f"{MAX_IMAGE_PIXELS} pixels an image, got {pairs[:4]}"
        )
    mask = images.pixel_attention_mask
    if mask:
        want = math.prod(shape[:-3] + shape[-2:])
        if len(shape) != 5 or len(mask) != want:
            return invalid(
                f"images.pixel_attention_mask must be a byte a pixel of [images, tiles, height, "
                f"width] ({want} for shape {shape}, 5 sizes), got {len(mask)}"
            )
        if mask.strip(b"\x00\x01"):
            return invalid("images.pixel_attention_mask must hold only bytes 0 and 1")
    return None


def _check_patch_grids(shape: list[int], grids: list[int]) -> Refusal | None:
    """check_pixel_values' part for pixel values that are a run of patches (Qwen2-VL): shape
    [patches, patch values] and a grid of three positive numbers an image, at most MAX_IMAGES,
    whose products add up to the patches."""
    if len(shape) != 2 or min(shape) < 1:
        return invalid(
            f"images.shape must be 2 positive sizes [patches, patch values] beside an "
            f"image_grid_thw, got {shape[:8]}"
        )
    if len(grids) % 3:
        return invalid(
            f"images.image_grid_thw must hold three numbers an image (frames, rows, columns), "
            f"got {len(grids)}"
        )
    count = len(grids) // 3
    if count > MAX_IMAGES:
        return invalid(f"a prompt holds {count} images; at most {MAX_IMAGES} are allowed")
    triples = list(zip(grids[::3], grids[1::3], grids[2::3]))
    patches = sum(t * h * w for t, h, w in triples)
    if min(grids) < 1 or patches != shape[0]:
        return invalid(
            f"images.image_grid_thw must be positive (frames, rows, columns) whose products add "
            f"up to the {shape[0]} patches of images.shape, got {triples[:4]}"
        )
    return None


def image_limit(value) -> int:
    """The images a prompt may hold under vLLM's limit_mm_per_prompt (`{"image": N}`, N from 0,
    which takes no image, to MAX_IMAGES; None or {}: MAX_IMAGES); a ValueError that says what to
    write for anything else, another modality included (only images are served)."""
    if value is None:
        return MAX_IMAGES
    if not isinstance(value, dict) or any(k != "image" for k in value):
        others = sorted(k for k in value if k != "image") if isinstance(value, dict) else None
        raise ValueError(
            f"limit_mm_per_prompt must be {{'image': N}} with N from 0 to {MAX_IMAGES}"
            + (f": only images are served, not {others[:3]}" if others else f", got {value!r:.80}")
        )
    n = value.get("image", MAX_IMAGES)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_IMAGES:
        raise ValueError(
            f"limit_mm_per_prompt's image must be a whole number from 0 to {MAX_IMAGES}, got {n!r:.40}"
        )
    return n


def mm_processor_kwargs(kwargs, where: str = "mm_processor_kwargs") -> dict:
    """vLLM's mm_processor_kwargs: a dict of the processor call's keyword arguments (None: {}),
    which the model's processor takes for a prompt's images (Qwen2-VL's min_pixels and
    max_pixels, a `size`); a ValueError naming `where` for anything else."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in kwargs
    ):
        raise ValueError(
            f"{where} must be a dict of the model processor's keyword arguments (such as "
            f'{{"max_pixels": 1003520}}), got {kwargs!r:.80}'
        )
    reserved = sorted(set(kwargs) & {"text", "images", "videos", "return_tensors"})
    if reserved:
        raise ValueError(f"{where} sets {reserved}, which the processor's caller passes itself")
    return dict(kwargs)
