"""The precision a runner serves in: its linears' quantization, chosen once as it starts.

This module owns the "auto" choice of the weights' mode, as kv_dtype.py owns the KV cache's and
EngineConfig.resolve the device's and dtype's: the model runner executes steps and holds the
model and the cache, and this module decides, through the runner's own forward passes, what
they run in. `start_runner` builds a runner, calls `choose_precision` (every tensor-parallel
rank does, so their collectives pair up) and only then captures the runner's decode graphs,
since a graph records the kernels of the final mode. `choose_precision`: quantization None
keeps the dense weights; a named mode is calibrated (int8 smooths its activations by each
channel's largest input on a calibration text) and kept; "auto" scores a probe text in float32,
then with each mode in order of speed on this CPU, and keeps the first that passes
engine/quality.judge: perplexity within its bound, teacher-forced top-1 agreement with float32,
and the same greedy answers to a few chat prompts (one prefill pass per mode gives the perplexity
and the top-1 tokens; the chat answers decode through the runner's own steps, all prompts in one
batch); then lets kv_dtype.py choose the cache's dtype by the same checks. Rank 0 judges and tells
the rest (parallel.agree); the chat tokens rank 0 samples reach the other ranks by an all-reduce,
so every rank runs the same steps. The calibration and probe texts are disjoint stretches of the
same corpus. Nothing here runs after the runner has started.

The verdict of "auto" is kept on disk (`VerdictCache`, the pdserve cache's precision/ folder), keyed
by everything it depends on: the model's files, the engine's settings (not the sizes of the KV
cache and of a sequence: only how much of the probe they allow, which is in its ids), the probe
and chat token ids, the quality bounds, the CPU's flags, torch's version and the engine's own
source; a one-rank runner that finds its key applies the kept verdict (the same linears,
smoothed by the calibration the probe's ran on, kept beside the verdict, the same cache dtype,
the note saying where it came from) instead of probing again, so only a machine's first start
of a model pays the probe and the calibration pass. The folder keeps the KEPT_VERDICTS most
recently used entries. Runners of several ranks always probe (every rank must take part).
PDSERVE_PRECISION_CACHE=0 turns it off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import time

import torch

from pdserve.engine.kv_dtype import auto_kv_dtype_applies, choose_kv_dtype
from pdserve.engine.model_runner import ModelInput, ModelRunner, SeqInput
from pdserve.engine.parallel import agree, all_reduce, from_rank0, is_first_rank
from pdserve.engine.quality import ProbeScore
from pdserve.engine.sampler import SamplingRow
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sleep import trim_heap

log = logging.getLogger(__name__)

# The calibration's smoothing search measures int8's error on about this many of its text's
# rows (every len(ids) // CALIBRATION_SEARCH_ROWS-th): SmolLM2 kept its gain at 256 of 512
CALIBRATION_SEARCH_ROWS = 256


def start_runner(
    config, model_config, model_dir: str, kv_cache_path: str | None = None, tokenizer=None
):
    """A ModelRunner ready to step: weights loaded, precision chosen, decode graphs captured.
    `tokenizer`: the model's, where the caller has it loaded (else loaded here if needed)."""
    runner = ModelRunner(config, model_config, model_dir, kv_cache_path)
    runner.quantization, runner.mode_note = choose_precision(runner, model_dir, tokenizer)
    runner.allocate_kv_cache()  # (allocated already where the probe ran)
    runner.capture_graphs()
    # the load's dense weights, which packing released, and the probes' scratch go back to the
    # system rather than staying in the heap's free lists (SmolLM2 float32 on an AVX2 EPYC, an
    # offline LLM: 683 MB of anonymous memory resident after the start, 544 MB with this)
    trim_heap()
    return runner


def choose_precision(runner: ModelRunner, model_dir: str, tokenizer=None) -> tuple[str | None, str]:
    """(the quantization the linears run in, None: config.dtype; the mode note saying why)."""
    config = runner.config
    wanted = config.quantization
    if wanted is None:
        runner.model.prepare_linears(None)
        return None, f"quantization=none ({config.dtype}), as configured"
    if wanted == "auto" and runner.model_config.num_labels:
        # the probe judges a mode by the LM head's logits, and a classifier checkpoint's LM head
        # is a stand-in (engine/score_head.py): nothing here could judge its scores
        runner.model.prepare_linears(None)
        return None, (
            f"quantization=none ({config.dtype}): a classifier checkpoint, whose scores the "
            "precision probe cannot judge"
        )
    from pdserve.engine.quality import PROBE_TOKENS, probe_ids
    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    length = min(PROBE_TOKENS, config.max_model_len, runner.num_blocks * runner.block_size)
    ids = probe_ids(tokenizer, length, skip=length) if length >= 64 else []
    calibration, probe = ids[:length], ids[length:]
    chat = chat_ids(runner, tokenizer) if wanted == "auto" else []
    cache = VerdictCache.of(runner, model_dir, ids, chat) if wanted == "auto" else None
    with cache.probing() if cache is not None else contextlib.nullcontext():
        return _choose(runner, wanted, cache, calibration, probe, length, chat)


def _choose(runner, wanted, cache, calibration, probe, length, chat) -> tuple[str | None, str]:
    """choose_precision's verdict once the probe text is known (and, under "auto", while this
    start holds its key's probe lock)."""
    config = runner.config
    kept = cache.load() if cache is not None else None
    # every quantized mode smooths activations by the calibration below: int8's linears, and the
    # int8 head of int4 and of bf16 (its screen); a kept verdict must serve what the probe judged,
    # so a quantized one comes with the calibration the probe ran on (else it is made again)
    if kept is not None and (kept[0] is None or cache.restore_calibration(runner)):
        return cache.apply(runner, *kept)
    runner.allocate_kv_cache()  # the calibration and the probes below step in it
    runner.model.prepare_linears(None, release_dense=False)
    from pdserve.engine.layers.quant import auto_candidates

    if calibration and (wanted != "auto" or auto_candidates()):  # (else nothing to smooth)
        calibrate(runner, calibration, wanted)
    if kept is not None:
        return cache.apply(runner, *kept)
    if wanted != "auto":
        runner.model.prepare_linears(wanted)
        return wanted, f"quantization={wanted} ({config.dtype}), as configured"
    chosen, note = _choose_quantization(runner, probe, length, chat)
    if cache is not None:
        kv_chosen = auto_kv_dtype_applies(config) and runner.kv_dtype == torch.bfloat16
        cache.store(runner, chosen, kv_chosen, note)
    return chosen, note


class VerdictCache:
    """quantization="auto"'s verdict for one runner's key, kept as a small JSON file (the module
    docstring), and beside it the calibration the probe ran on (every linear's act_absmax, a
    safetensors file, ~4 bytes per input channel per linear), so a quantized verdict is applied
    without the float32 calibration pass. `of` gives None where it does not apply (several ranks,
    turned off, no cache folder); load and store never fail a start: an unreadable entry is a
    miss, a calibration file that does not name every linear of the model with its width a miss
    of the calibration only, an unwritable folder a warning."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    @classmethod
    def of(cls, runner: ModelRunner, model_dir: str, ids: list[int], chat: list[list[int]]):
        from pdserve.engine.kv_dtype import why_bf16_is_not_faster
        from pdserve.engine.layers.quant import auto_candidates
        from pdserve.engine.loader.resolve import default_cache_dir
        from pdserve.engine.quality import AGREEMENT_BOUND, QUALITY_BOUNDS

        config = runner.config
        if os.environ.get("PDSERVE_PRECISION_CACHE", "1") == "0":
            return None
        if config.tensor_parallel_size * config.pipeline_parallel_size != 1:
            return None
        try:
            files = sorted(
                (p.name, p.stat().st_size, p.stat().st_mtime_ns)
                for p in pathlib.Path(model_dir).iterdir()
                if p.is_file()
            )
        except OSError:
            return None
        from pdserve.engine.cpu import cpu_features

        material = {
            "model": [str(pathlib.Path(model_dir).resolve()), files],
            # not max_model_len or the KV cache's size: what they allow the probe (how much
            # text, whether the chat check runs) is in "ids", so a deployment that only sizes
            # its cache or its sequences differently keeps the verdict
            "config": [
                str(config.dtype),
                str(config.device),
                str(config.kv_cache_dtype),
                config.block_size,
                str(config.load_format),
                config.seed,
            ],
            "ids": hashlib.sha256(json.dumps([ids, chat]).encode()).hexdigest(),
            "bounds": [repr(sorted(QUALITY_BOUNDS.items())), AGREEMENT_BOUND],
            "kv_rule": why_bf16_is_not_faster(runner) if runner.device.type == "cpu" else "",
            "candidates": list(auto_candidates()),
            "cpu": sorted(cpu_features().flags),
            "torch": torch.__version__,
            "source": _engine_source_hash(),
        }
        key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
        return cls(default_cache_dir() / "precision" / f"{key}.json")

    @contextlib.contextmanager
    def probing(self, wait_s: float | None = None):
        """Held while this start loads, probes and keeps its key's verdict: a second start of the
        same key on this machine (the other pool's worker of one deployment, started at the same
        moment) waits for the first one's verdict and applies it, instead of probing beside it on
        the same cores, which made both take twice as long. The lock is an flock on a file beside
        the entry, which the kernel releases when its holder exits or dies; a start that has
        waited wait_s (PROBE_WAIT_S) probes without it. A folder that cannot be written has no
        lock: every start probes."""
        wait_s = PROBE_WAIT_S if wait_s is None else wait_s
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            deadline, said = time.monotonic() + wait_s, False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning(
                            "another start's precision probe took over %.0fs: probing", wait_s
                        )
                        break
                    if not said:
                        log.info("waiting for another start's precision probe of this model")
                        said = True
                    time.sleep(PROBE_POLL_S)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    @property
    def lock_path(self) -> pathlib.Path:
        return self.path.with_suffix(".lock")

    def load(self) -> tuple[str | None, bool, str] | None:
        try:
            entry = json.loads(self.path.read_text())
            found = entry["quantization"], bool(entry["kv_bfloat16"]), str(entry["note"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        with contextlib.suppress(OSError):  # used now: the last to be pruned (_prune)
            os.utime(self.path)
        return found

    @property
    def calibration_path(self) -> pathlib.Path:
        return self.path.with_suffix(".calibration.safetensors")

    def store(
        self, runner: ModelRunner, quantization: str | None, kv_bfloat16: bool, note: str
    ) -> None:
        """Keeps the verdict and, for a quantized one, the runner's calibration (written first:
        the JSON entry is what a later start looks for)."""
        from safetensors.torch import save_file

        entry = {
            "quantization": quantization,
            "kv_bfloat16": kv_bfloat16,
            "note": note,
            "probed_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _prune(self.path.parent)
        except OSError as e:
            log.warning("precision verdict not kept (%s): the next start probes again", e)
            return
        if quantization is not None:
            found = {name: m.act_absmax for name, m in _linears(runner)}
            seen = {k: v.contiguous() for k, v in found.items() if v is not None}
            # the linears the calibration never reached (an expert no token went to; all of
            # them where there was no probe text) are named, so they stay unsmoothed again
            unreached = json.dumps(sorted(k for k, v in found.items() if v is None))
            alphas = json.dumps({k: m.smooth_alpha for k, m in _linears(runner) if k in seen})
            tmp = self.calibration_path.with_suffix(f".{os.getpid()}.tmp")
            try:
                meta = {"unreached": unreached, "alphas": alphas}
                save_file(seen, str(tmp), metadata=meta)
                os.replace(tmp, self.calibration_path)
            except Exception as e:  # the verdict is still kept: the next start calibrates
                tmp.unlink(missing_ok=True)
                log.warning("precision calibration not kept (%s): the next start makes it", e)
        try:
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("precision verdict not kept (%s): the next start probes again", e)

    def restore_calibration(self, runner: ModelRunner) -> bool:
        """Sets every linear's act_absmax and smooth_alpha from the kept calibration; False
        (nothing set) where there is none or it does not fit the model: every linear named once,
        as reached (a finite float32 vector of its input width, and one of quant.SMOOTH_ALPHAS or
        None where the mode did not search) or as unreached."""
        from safetensors import safe_open

        from pdserve.engine.layers.quant import SMOOTH_ALPHAS

        try:
            with safe_open(str(self.calibration_path), "pt") as f:
                kept = {k: f.get_tensor(k) for k in f.keys()}
                meta = f.metadata() or {}
                unreached, alphas = json.loads(meta["unreached"]), json.loads(meta["alphas"])
        except Exception:  # missing, truncated or not ours: calibrate instead
            return False
        linears = dict(_linears(runner))
        if not isinstance(unreached, list) or set(kept) | set(unreached) != set(linears):
            return False
        if set(kept) & set(unreached) or not isinstance(alphas, dict) or set(alphas) != set(kept):
            return False
        for name, v in kept.items():
            if v.dtype != torch.float32 or v.shape != (linears[name].weight.shape[1],):
                return False
            if not bool(torch.isfinite(v).all()):
                return False
            if alphas[name] is not None and alphas[name] not in SMOOTH_ALPHAS:
                return False
        for name, m in linears.items():
            m.act_absmax, m.smooth_alpha = kept.get(name), alphas.get(name)
        return True

    def apply(self, runner: ModelRunner, quantization: str | None, kv_bfloat16: bool, note: str):
        runner.model.prepare_linears(quantization)
        if kv_bfloat16:
            runner.set_kv_dtype(torch.bfloat16)
        return quantization, f"{note} [{KEPT_NOTE}: {self.path.name}]"


KEPT_NOTE = "kept from this machine's earlier probe"
# a start waits at most this long for another start's probe of the same key, polling this often
PROBE_WAIT_S = 600.0
PROBE_POLL_S = 0.2


def mode_headline(note: str) -> str:
    """A mode note's verdicts without their reasons, for one-line logs (the launcher's "serving
    on" line; the whole note is the start's precision stage and the worker's log): the weights'
    verdict (the note up to its first ": "), the KV cache's where "auto" chose it, and whether
    the verdict was kept from an earlier probe."""
    head = note.split(": ", 1)[0].split(" [", 1)[0]
    kv = re.search(r"kv_cache_dtype=auto chose \w+", note)
    if kv is not None:
        head += f"; {kv.group(0)}"
    if f"[{KEPT_NOTE}" in note:
        head += f" ({KEPT_NOTE})"
    return head


KEPT_VERDICTS = 256  # entries of the precision folder kept, the most recently used
STALE_TMP_S = 3600.0  # a half-written file this old was left by a process that died


def _prune(folder: pathlib.Path) -> None:
    """Bounds the precision folder: every engine upgrade, model path or setting is a new key, so
    without this it would only grow. Drops the entries (verdict and calibration) past the
    KEPT_VERDICTS most recently used, and half-written files a dead process left. Another
    process pruning at the same time is harmless: a verdict removed under a start is a miss."""
    now = time.time()
    entries = []
    for path in folder.iterdir():
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if path.suffix == ".tmp" and now - mtime > STALE_TMP_S:
            path.unlink(missing_ok=True)
        elif path.suffix == ".json":
            entries.append((mtime, path))
    entries.sort(reverse=True)
    for _, path in entries[KEPT_VERDICTS:]:
        path.with_suffix(".calibration.safetensors").unlink(missing_ok=True)
        path.with_suffix(".lock").unlink(missing_ok=True)
        path.unlink(missing_ok=True)


@functools.cache
def _engine_source_hash() -> str:
    """The engine package's Python and C++ sources, hashed: another engine version, another key."""
    root = pathlib.Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp") and path.is_file():
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def chat_ids(runner: ModelRunner, tokenizer) -> list[list[int]]:
    """The chat prompts of engine/quality.py as token ids, [] when the KV cache or max_model_len
    cannot hold them with their answers (the chat check is then left out, and the note says so)."""
    from pdserve.engine.quality import CHAT_PROBE_TOKENS, chat_prompt_ids

    prompts = chat_prompt_ids(tokenizer)
    longest = max(len(p) for p in prompts) + CHAT_PROBE_TOKENS
    if longest > runner.config.max_model_len or chat_blocks(runner, prompts) > runner.num_blocks:
        return []
    return prompts


def _linears(runner: ModelRunner) -> list[tuple[str, torch.nn.Module]]:
    from pdserve.engine.layers.linear import LinearBase

    return [(n, m) for n, m in runner.model.named_modules() if isinstance(m, LinearBase)]


def calibrate(runner: ModelRunner, ids: list[int], mode: str = "int8") -> None:
    """Sets, for every linear, the largest |input| per channel over `ids` (int8 smooths its
    activations by it; see engine/layers/quant.py) and, where `mode` serves its int8 product
    (_int8_served), the smoothing strength that makes that product err least on the text. Two
    passes over `ids`: the maxima first, then each strength's error summed over the same inputs
    (quant.smoothing_errors, on about CALIBRATION_SEARCH_ROWS of its rows). One strength for
    every layer was a draw: SmolLM2's int8 probe perplexity moved by 1.7 points with the
    maxima's last bits, where a strength per linear keeps it lower on every draw tried
    (docs/experiments/int8-agreement.md). The passes run the layers one by one: the compiled
    decode stack (models/llama.py), which float32 on a CPU takes for every step of the probe,
    runs all layers in one call that no forward hook sees. A linear the text never reaches (an
    expert no token was routed to) keeps act_absmax None and is quantized unsmoothed."""
    from pdserve.engine.layers.quant import SMOOTH_ALPHAS, smoothing_errors

    def record(module, args, _out):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        seen = module.act_absmax
        module.act_absmax = x if seen is None else torch.maximum(seen, x)

    stride = max(1, len(ids) // CALIBRATION_SEARCH_ROWS)
    errors: dict[torch.nn.Module, torch.Tensor] = {}

    def measure(module, args, _out):
        x = args[0].detach().reshape(-1, args[0].shape[-1])[::stride]
        e = smoothing_errors(module.weight, module.act_absmax, x, SMOOTH_ALPHAS)
        errors[module] = errors[module] + e if module in errors else e

    linears = [m for _, m in _linears(runner)]
    for m in linears:
        m.act_absmax = m.smooth_alpha = None
    _layer_by_layer(runner, linears, record, ids)
    searched = [m for m in _int8_served(runner, mode) if m.act_absmax is not None]
    if not searched:
        return
    _layer_by_layer(runner, searched, measure, ids)
    none = torch.zeros(len(SMOOTH_ALPHAS), dtype=torch.float64)
    table = torch.stack([errors.get(m, none) for m in searched])
    # summed over the tensor-parallel ranks: a linear's shards take the strength that suits
    # the whole linear, as one rank would choose it (every rank reached the same linears)
    all_reduce(table)
    for m, row in zip(searched, table, strict=True):
        m.smooth_alpha = SMOOTH_ALPHAS[int(row.argmin())]


def _int8_served(runner: ModelRunner, mode: str) -> list[torch.nn.Module]:
    """The linears whose int8 product `mode` serves as it is, where the smoothing search pays:
    every one under int8 and under auto (whose probe tries int8), the LM head under int4 (its
    head stays int8); none under bf16, whose int8 screen only picks the candidates it rescores
    in float32."""
    if mode in ("int8", "auto"):
        return [m for _, m in _linears(runner)]
    if mode == "int4":
        head = getattr(runner.model, "lm_head", None)
        return [m for _, m in _linears(runner) if m is head]
    return []


def _layer_by_layer(runner: ModelRunner, linears, hook, ids: list[int]) -> None:
    """One pass over `ids` with `hook` on each of `linears`, the compiled stacks set aside."""
    hooks = [m.register_forward_hook(hook) for m in linears]
    stacks = [m for m in runner.model.modules() if getattr(m, "_stack", None) is not None]
    held = [m._stack for m in stacks]
    try:
        for m in stacks:
            m._stack = None
        probe_perplexity(runner, ids)
    finally:
        for m, stack in zip(stacks, held, strict=True):
            m._stack = stack
        for h in hooks:
            h.remove()


def _choose_quantization(runner: ModelRunner, ids: list[int], length: int, chat: list[list[int]]):
    """quantization="auto": the first mode, in order of speed, within its bound of float32's
    probe perplexity; then the KV cache's dtype (kv_dtype.py)."""
    chosen: str | None = None
    judged: float | None = None  # float32's probe perplexity where it can judge a mode
    if not ids:
        note = (
            f"float32: no probe text (the probe needs 64 tokens of English; max_model_len "
            f"and the KV cache allow {length}, or the tokenizer cannot spell it)"
        )
    else:
        chosen, judged, note = _probe_modes(runner, ids, chat)
    runner.model.prepare_linears(chosen)  # the final mode, and the dense weights released
    note = f"quantization=auto chose {chosen or 'none'} ({runner.config.dtype}): {note}"
    if auto_kv_dtype_applies(runner.config):  # the KV cache's dtype by the same probe
        note += "; " + choose_kv_dtype(runner, ids, judged, chosen, chat)
    return chosen, note


def _probe_modes(runner: ModelRunner, ids: list[int], chat: list[list[int]]):
    """(the chosen mode or None, float32's ProbeScore if it can judge, the words on rank 0)."""
    from pdserve.engine.layers.quant import auto_candidates
    from pdserve.engine.quality import QUALITY_BOUNDS, informative, judge

    note = ""
    chosen = None
    base = probe_score(runner, ids, chat)
    ppl = base.perplexity if base is not None else None
    if not agree(ppl is not None and informative(ppl, runner.model_config.vocab_size)):
        note = (
            f"float32: the model does not predict the probe text (perplexity "
            f"{ppl if ppl is not None else float('nan'):.1f}), so no mode's quality "
            "can be judged"
        )
    judged = None if note else base
    if not note and not auto_candidates():
        note = (
            "float32: no quantized mode runs faster on this CPU (it has no int8 or bf16 "
            "dot-product units)"
        )
    if not note and not chat and is_first_rank():
        note = "no chat check (the KV cache or max_model_len cannot hold the chat prompts); "
    for mode in auto_candidates() if not note.startswith("float32") else ():
        runner.model.prepare_linears(mode, release_dense=False)
        score = probe_score(runner, ids, chat)
        ok = False
        if is_first_rank():
            ok, words = judge(score, base, QUALITY_BOUNDS[mode], _eos(runner))
            note += f"{mode}: {words}; "
        if agree(ok):
            chosen = mode
            break
    # (only rank 0 words the probes; the others know the verdict)
    note = note.rstrip("; ") or ("float32: no quantization mode passed" if chosen is None else "")
    if chosen is None and judged is not None and auto_candidates() and is_first_rank():
        note += "; float32 kept"
    return chosen, judged, note


def _eos(runner: ModelRunner) -> tuple[int, ...]:
    return tuple(runner.model_config.eos_token_ids or ())


def probe_score(runner: ModelRunner, ids: list[int], chat: list[list[int]]) -> ProbeScore | None:
    """The probe in the runner's current mode, on rank 0 (None on the others): one prefill pass
    of `ids` gives its perplexity and the top-1 token at each position (prompt_topk=1), then the
    greedy answers to `chat` (every rank runs the same steps)."""
    from pdserve.engine.quality import perplexity, top1

    rows = probe_rows(runner, ids)
    answers = greedy_chat(runner, chat)
    if not is_first_rank():
        return None
    return ProbeScore(perplexity(rows, ids), top1(rows), answers)


def probe_rows(runner: ModelRunner, ids: list[int]) -> list[dict[int, float]]:
    """Rank 0: per position p, {top-1 token: logprob, ids[p + 1]: logprob}; [] elsewhere."""
    seq = SeqInput(
        token_ids=ids,
        start=0,
        block_ids=list(range(-(-len(ids) // runner.block_size))),
        samples=False,
        prompt_targets=ids[1:],
        prompt_topk=1,
        state_slot=0,
    )
    out = runner.execute(ModelInput([seq], []), rows=[] if is_first_rank() else None)
    return out.prompt_logprobs.get(0, []) if is_first_rank() else []


def chat_blocks(runner: ModelRunner, prompts: list[list[int]]) -> int:
    """KV blocks the chat prompts and their CHAT_PROBE_TOKENS answers hold, side by side."""
    from pdserve.engine.quality import CHAT_PROBE_TOKENS

    bs = runner.block_size
    return sum(-(-(len(p) + CHAT_PROBE_TOKENS) // bs) for p in prompts)


def greedy_chat(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's first CHAT_PROBE_TOKENS greedy tokens, all prompts in one batch through the
    runner's own steps (a prefill step, then one decode step a token), in the KV cache's first
    blocks (no request holds any yet); on rank 0 ([] elsewhere). The tokens rank 0 samples reach
    the other ranks by an all-reduce, so every rank feeds the next step the same tokens."""
    from pdserve.engine.quality import CHAT_PROBE_TOKENS

    if not prompts:
        return []
    bs, first = runner.block_size, 0
    blocks = []
    for p in prompts:
        n = -(-(len(p) + CHAT_PROBE_TOKENS) // bs)
        blocks.append(list(range(first, first + n)))
        first += n
    params = SamplingParams(temperature=0, max_tokens=CHAT_PROBE_TOKENS, ignore_eos=True)
    answers: list[list[int]] = [[] for _ in prompts]
    rows = [SamplingRow(params, p, a, None) for p, a in zip(prompts, answers)]
    # (a hybrid model's state: slot i, held by no request yet, as the blocks)
    seqs = [
        SeqInput(p, 0, b, samples=True, state_slot=i)
        for i, (p, b) in enumerate(zip(prompts, blocks))
    ]
    for _ in range(CHAT_PROBE_TOKENS):
        out = runner.execute(
            ModelInput(seqs, []),
            rows=rows if is_first_rank() else None,
            row_logits=list(range(len(prompts))),
        )
        tokens = from_rank0(out.token_ids if is_first_rank() else [0] * len(prompts))
        for a, t in zip(answers, tokens):
            a.append(t)
        seqs = [
            SeqInput([a[-1]], len(p) + len(a) - 1, b, samples=True, state_slot=i)
            for i, (p, a, b) in enumerate(zip(prompts, answers, blocks))
        ]
    return answers if is_first_rank() else []


def probe_perplexity(runner: ModelRunner, ids: list[int]) -> float | None:
    """The perplexity of `ids` on rank 0 (None on the others), through the KV cache's first
    blocks (no request holds any yet)."""
    from pdserve.engine.quality import perplexity

    rows = probe_rows(runner, ids)
    return perplexity(rows, ids) if is_first_rank() else None
