"""quantization="auto"'s verdict kept on disk (engine/precision.py VerdictCache): a second start of
the same model on the same machine applies the first start's verdict without probing (same mode,
same KV cache dtype, same tokens, the note saying so); anything the verdict depends on (here the
quality bounds) gives another key, so that start probes again; PDSERVE_PRECISION_CACHE=0 probes
every time. A tiny random model predicts no text, so the probe is declared informative and the
bounds widened: the verdict is then a quantized mode with a bf16 cache."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.engine import needs_x86_int8
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams, precision
from pdserve.engine.kernels import cpu_paged_decode
from pdserve.engine.quality import QUALITY_BOUNDS

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    needs_x86_int8,
    pytest.mark.skipif(cpu_paged_decode() is None, reason="no compiled paged decode kernel"),
]
KV_BYTES = 1 << 22


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """A cache folder of the test's own, wide bounds, and a count of the probes run."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_PRECISION_CACHE", raising=False)
    monkeypatch.setattr("pdserve.engine.quality.informative", lambda ppl, vocab: True)
    monkeypatch.setattr("pdserve.engine.quality.AGREEMENT_BOUND", 0.0)
    monkeypatch.setattr("pdserve.engine.precision.chat_ids", lambda runner, tokenizer: [])
    for mode in ("bfloat16", "int8", "int4", "bf16"):
        monkeypatch.setitem(QUALITY_BOUNDS, mode, 1.0)
    count = []
    real = precision._probe_modes
    monkeypatch.setattr(precision, "_probe_modes", lambda *a: count.append(1) or real(*a))
    return count


@pytest.fixture
def calibrations(monkeypatch):
    """A count of the float32 calibration passes run."""
    count = []
    real = precision.calibrate
    monkeypatch.setattr(precision, "calibrate", lambda *a: count.append(1) or real(*a))
    return count


def kv_allocations(monkeypatch) -> list[torch.dtype]:
    """The dtype of every KV cache the runners allocate from now on, in order."""
    from pdserve.engine.model_runner import ModelRunner

    seen = []
    real = ModelRunner._new_kv_cache

    def new(runner):
        seen.append(runner.kv_dtype)
        return real(runner)

    monkeypatch.setattr(ModelRunner, "_new_kv_cache", new)
    return seen


def start(model_dir, **kwargs):
    llm = LLM(model_dir, **{"kv_cache_memory": KV_BYTES, **kwargs})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    outs = llm.generate([[5, 6, 7] * 30, [9] * 40], params, use_tqdm=False)
    eng = llm.engine
    seen = (
        eng.config.quantization,
        eng.kv_cache.dtype,
        [list(o.outputs[0].token_ids) for o in outs],
        eng.mode_note,
        # every logit counts in a logprob (its normalizer), not only the greedy one
        [list(o.outputs[0].logprobs) for o in outs],
    )
    assert_no_leaks(eng)
    llm.shutdown()
    return seen


@pytest.mark.parametrize("chosen", ["int8", "bf16"])
def test_a_second_start_applies_the_kept_verdict_without_probing(
    tiny_models, probes, calibrations, monkeypatch, tmp_path, chosen
):
    """int8's own linears smooth by the calibration; bf16's screened head (and int4's int8 head)
    too. The calibration is kept beside the verdict, so the second start runs neither the probe
    nor the calibration pass; a calibration file that does not fit is made again."""
    from pdserve.engine.layers import quant

    if chosen not in quant.auto_candidates():
        pytest.skip(f"{chosen} is not a candidate on this CPU")
    monkeypatch.setattr(quant, "auto_candidates", lambda: [chosen])
    allocated = kv_allocations(monkeypatch)
    model_dir, _ = tiny_models("llama-gqa")
    mode, kv, tokens, note, logprobs = start(model_dir)
    assert len(probes) == 1 and len(calibrations) == 1 and "kept from" not in note
    assert mode == chosen and kv == torch.bfloat16, note  # what the wide bounds let through
    # the probe steps in a float32 cache, which the verdict then replaces
    assert allocated == [torch.float32, torch.bfloat16]
    [kept] = (tmp_path / "precision").glob("*.calibration.safetensors")
    allocated.clear()
    again = start(model_dir)
    assert len(probes) == 1, "the second start probed again"
    assert allocated == [torch.bfloat16], "a kept verdict's cache is allocated once, in its dtype"
    assert len(calibrations) == 1, "the second start ran the calibration pass again"
    assert again[:3] == (mode, kv, tokens)
    assert again[3].startswith(note) and "kept from this machine's earlier probe" in again[3]
    # the launcher's one-line form of both notes: the verdicts, none of the reasons
    headline = f"quantization=auto chose {mode} (float32); kv_cache_dtype=auto chose bfloat16"
    assert precision.mode_headline(note) == headline
    assert (
        precision.mode_headline(again[3]) == headline + " (kept from this machine's earlier probe)"
    )
    # the model served is the one the probe judged: a quantized head's int8 screen smooths its
    # inputs by the calibration as it did then (a kept verdict once skipped the calibration and
    # served other logits beside the same greedy tokens)
    assert again[4] == logprobs

    # a kept calibration with a linear missing, or one cut short: calibrated again, same model
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    full = load_file(str(kept))
    with safe_open(str(kept), "pt") as f:
        meta = f.metadata()
    save_file(dict(list(full.items())[1:]), str(kept), metadata=meta)
    assert start(model_dir)[4] == logprobs and len(calibrations) == 2
    kept.write_bytes(kept.read_bytes()[:100])
    assert start(model_dir)[4] == logprobs and len(calibrations) == 3
    # one without the smoothing strengths (an older engine's), or with one outside the grid
    save_file(full, str(kept), metadata={"unreached": meta["unreached"]})
    assert start(model_dir)[4] == logprobs and len(calibrations) == 4
    alphas = json.loads(meta["alphas"])
    alphas[next(iter(alphas))] = 0.123
    save_file(full, str(kept), metadata={**meta, "alphas": json.dumps(alphas)})
    assert start(model_dir)[4] == logprobs and len(calibrations) == 5
    assert len(probes) == 1


def test_a_start_waits_for_another_start_probing_the_same_key(
    tiny_models, probes, monkeypatch, tmp_path
):
    """While another start holds the key's probe lock (the other worker of one deployment,
    probing now), a start waits and then applies that start's verdict without probing; one that
    has waited PROBE_WAIT_S probes itself."""
    import fcntl
    import os
    import threading
    import time

    model_dir, _ = tiny_models("llama-gqa")
    first = start(model_dir)
    [entry] = (tmp_path / "precision").glob("*.json")
    kept = entry.read_bytes()
    entry.unlink()  # as if the other start had not stored it yet

    def hold():
        fd = os.open(entry.with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    fd = hold()
    result = []
    waiter = threading.Thread(target=lambda: result.append(start(model_dir)))
    waiter.start()
    time.sleep(1.0)
    assert not result and len(probes) == 1, "a start probed beside the one holding the lock"
    entry.write_bytes(kept)  # the other start stores its verdict, and lets go
    os.close(fd)
    waiter.join(60)
    assert result and len(probes) == 1
    assert result[0][:3] == first[:3] and "kept from this machine's earlier probe" in result[0][3]

    entry.unlink()
    fd = hold()
    monkeypatch.setattr(precision, "PROBE_WAIT_S", 0.3)
    try:
        assert start(model_dir)[:3] == first[:3]
    finally:
        os.close(fd)
    assert len(probes) == 2, "a start that waited past the bound did not probe"


def test_another_bound_or_the_switch_off_probes_again(tiny_models, probes, monkeypatch):
    model_dir, _ = tiny_models("llama-gqa")
    start(model_dir)
    monkeypatch.setitem(QUALITY_BOUNDS, "int8", 0.9)  # another bound: another key
    start(model_dir)
    assert len(probes) == 2
    monkeypatch.setenv("PDSERVE_PRECISION_CACHE", "0")
    start(model_dir)
    assert len(probes) == 3


def test_another_cache_size_keeps_the_verdict_and_a_shorter_probe_does_not(tiny_models, probes):
    """The key holds what the probe ran on, not the sizes that allowed it: twice the KV cache
    runs the same probe (kept), a max_model_len below the probe's length cuts it (probed)."""
    from pdserve.engine.quality import PROBE_TOKENS

    model_dir, _ = tiny_models("llama-gqa")
    first = start(model_dir)
    again = start(model_dir, kv_cache_memory=2 * KV_BYTES)
    assert len(probes) == 1, "a larger KV cache probed again"
    assert again[:3] == first[:3] and "kept from this machine's earlier probe" in again[3]
    start(model_dir, max_model_len=PROBE_TOKENS // 2)
    assert len(probes) == 2


def test_the_folder_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    """Every engine version, model path and setting is a key of its own: the folder drops the
    entries used longest ago past KEPT_VERDICTS, with their calibration, and half-written files
    a dead process left; a verdict just read counts as used."""
    import os
    import time

    monkeypatch.setattr(precision, "KEPT_VERDICTS", 3)
    folder = tmp_path / "precision"
    folder.mkdir()
    now = time.time()
    for i in range(5):  # entry 0 the oldest
        for name in (f"k{i}.json", f"k{i}.calibration.safetensors"):
            (folder / name).write_text('{"quantization": null, "kv_bfloat16": false, "note": ""}')
            os.utime(folder / name, (now - 100 + i, now - 100 + i))
    (folder / "k9.123.tmp").write_text("")
    os.utime(folder / "k9.123.tmp", (now - 7200, now - 7200))
    (folder / "k8.124.tmp").write_text("")  # being written now
    assert precision.VerdictCache(folder / "k0.json").load() is not None  # used now

    precision._prune(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "k0.calibration.safetensors",
        "k0.json",
        "k3.calibration.safetensors",
        "k3.json",
        "k4.calibration.safetensors",
        "k4.json",
        "k8.124.tmp",
    ]


def test_the_headline_of_a_configured_mode_is_its_note():
    """A configured mode's note is already one line: its headline is the note itself."""
    for note in (
        "quantization=none (float32), as configured",
        "quantization=int8 (float32), as configured",
    ):
        assert precision.mode_headline(note) == note
