"""Shared fixtures: tiny random Llama-family models saved as HF directories, and leak checks."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

# the fast lane's guard (tests/fast_lane.py): pytest finds hooks and fixtures by their names here
from fast_lane import (  # noqa: F401
    fast_lane_contract,
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
)

os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")


def pytest_runtest_setup(item):
    """Tests marked `gpu` (tests/gpu) need CUDA: skipped where torch sees no GPU."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip(
            "needs CUDA (a `gpu` test): run on a GPU machine with `pytest -m gpu tests/gpu`"
        )


torch.set_num_threads(min(2, os.cpu_count() or 1))

# the tiny models' shape: 2 layers, 64 wide, a 256-token vocabulary
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}
# name: (architecture, num_key_value_heads, tie_word_embeddings, rope_parameters); 4 query heads
_SHAPES = {
    "llama-gqa": ("llama", 2, False, None),
    "llama-mqa-tied": ("llama", 1, True, None),
    "llama3-rope": ("llama", 2, False, LLAMA3_ROPE),
    "qwen2-bias": ("qwen2", 2, True, None),
    "qwen2-yarn": ("qwen2", 2, False, YARN_ROPE),
}
TINY_SHAPES = {  # name: (architecture, extra config)
    name: (
        arch,
        dict(
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            tie_word_embeddings=tied,
            **({} if rope is None else {"rope_parameters": rope}),
        ),
    )
    for name, (arch, kv_heads, tied, rope) in _SHAPES.items()
}


def make_tiny_model(path, kind: str = "llama-gqa", seed: int = 0):
    """Save a random tiny model + a word-level tokenizer ("t0".."t255") to `path`; returns the HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    arch, extra = TINY_SHAPES[kind]
    common = dict(**TINY_CONFIG, eos_token_id=1, bos_token_id=0, **extra)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random biases, so a dropped bias cannot go unnoticed
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.eval().save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        path
    )
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (model_dir, HF reference model), built once per session."""
    cache = {}

    def get(kind: str = "llama-gqa"):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            cache[kind] = (str(path), make_tiny_model(path, kind))
        return cache[kind]

    return get


def wait_until(cond, timeout: float, what: str, poll_s: float = 0.02) -> None:
    """Polls `cond` until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout}s: {what}")


def run_in_threads(fn, n: int, timeout: float = 60.0) -> dict:
    """fn(0) .. fn(n - 1), each on its own thread, all at once: {i: what fn(i) returned}. The
    threads' exceptions fail the caller (not lost in the threads)."""
    results, errors = {}, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # surfaced below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return results


def non_daemon_threads() -> set:
    return {t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()}


@contextlib.contextmanager
def leaves_no_threads(timeout: float = 5.0):
    """Fails if the block leaves non-daemon threads behind for more than `timeout` seconds."""
    before = non_daemon_threads()
    yield
    wait_until(
        lambda: non_daemon_threads() <= before,
        timeout,
        f"threads left: {non_daemon_threads() - before}",
    )


@contextlib.contextmanager
def threads_joined(timeout: float):
    """Fails if a thread the block started (daemon or not) is still alive `timeout` seconds after
    it ended."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + timeout
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"threads left behind: {sorted(t.name for t in left)}"


def random_prompts(lengths, seed: int = 0, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Plain argmax decoding with HF's own model and KV cache.

    Not `generate(min_new_tokens=...)`: that masks EOS, while `ignore_eos` (here and in vLLM) only
    means "do not stop at EOS", so EOS can still be the greedy token.
    """
    ids, past, out = torch.tensor([prompt_ids]), None, []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            step = model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def assert_no_leaks(engine) -> None:
    """Every block is free or evictable (cached, ref 0) and the block accounting is consistent."""
    bm = engine.block_manager
    bm.check_consistency()
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks still referenced"


# ---- engine tests on the tiny models (tests/*/test_engine_*.py) -----------------------------
LENGTHS = (1, 5, 16, 17, 40, 100, 200)  # the reference prompts' lengths
NEW = 24  # new tokens of each HF greedy reference continuation
SHARED_PREFIX = 48  # the shared prefix of the last three reference prompts


@pytest.fixture(scope="module")
def one_thread():
    """A 64-wide model gains nothing from a second thread, and on a shared 2-core machine OpenMP
    spin-waiting made each step ~20x slower (58 ms vs 2 ms); restored after the module.
    The engine test modules use it for all their tests: pytestmark = usefixtures("one_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def refs(tiny_models):
    """kind -> (model_dir, hf_model, prompts, HF greedy continuations); prompts end with three
    that share a 48-token prefix, so the prefix cache has something to hit."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model_dir, hf = tiny_models(kind)
            prompts = random_prompts(LENGTHS, seed=11)
            prefix = random_prompts([SHARED_PREFIX], seed=12)[0]
            prompts += [prefix + tail for tail in random_prompts([3, 20, 33], seed=13)]
            cache[kind] = (model_dir, hf, prompts, [hf_greedy(hf, p, NEW) for p in prompts])
        return cache[kind]

    return get


def tls_files(tmp_path) -> dict:
    """A CA and a certificate it signed for 127.0.0.1, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(subject, key, issuer, issuer_key, ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # noqa: E731
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = issue(name("pdserve-test-ca"), ca_key, name("pdserve-test-ca"), ca_key, ca=True)
    cert = issue(name("router"), key, ca.subject, ca_key, ca=False)
    files = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files
