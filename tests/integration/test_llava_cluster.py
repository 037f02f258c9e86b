"""A vision-language model through the disaggregated cluster: a tiny random LLaVA
(tests/helpers/vlm.py) behind a Router with its HTTP front, a prefill worker and a decode worker
in this process. A chat with images, over gRPC (pdserve.v1.ContentPart) and over HTTP (OpenAI's
image_url parts with base64 data URLs), gives transformers' own greedy tokens for the prompt the
model's processor makes; the prefill worker runs the images and hands the prompt's KV over, and
the decode worker keys the blocks it receives by the images: the same chat with another image
gives that image's tokens (a cache keyed by the text alone would hand the first image's KV to
it), and the same image again is served from the prefix cache. Images a model of text only is
sent, too many images, and bytes that are no image are refused by name; the cluster serves on.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import time

import grpc
import pytest

from helpers.http import post
from helpers.threads import wait_until
from helpers.vlm import (
    GEMMA3_IMAGE_TOKEN_ID,
    QWEN2_VL_IMAGE_TOKEN_ID,
    hf_gemma3_vl,
    hf_llava_greedy,
    hf_qwen2_vl,
    llava_inputs,
    make_tiny_gemma3_vl,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    qwen2_vl_processor,
    random_images,
)
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(dtype="float32", max_model_len=256)
MAX_TOKENS = 8
# a block of text (16 tokens), then the image's 16 tokens fill the next block: a cache keyed by
# the text alone would give the second image's chat the first image's KV whole. (Words from t20
# on: the test tokenizer splits "t10" into its special "t1" and an unknown "0".)
PREFIX = " ".join(f"t{i}" for i in range(20, 36))
SUFFIX = "t5"  # after which this tiny model's tokens depend on the image


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava"))
    return path, make_tiny_llava(path)


@pytest.fixture(scope="module")
def cluster(llava):
    path, _ = llava
    decode = start_decode(path, engine=ENGINE)
    prefill = start_prefill(path, engine=ENGINE)
    router = start_router(path, decode, prefill, http_port=0, max_model_len=256)
    channel = grpc.insecure_channel(router.address)
    yield router, prefill, decode, pdserve_pb2_grpc.PDServeStub(channel)
    stop_all([channel], router, prefill, decode)


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")  # lossless: the processor sees the same pixels
    return out.getvalue()


def hf_tokens(llava, image) -> list[int]:
    """HF's greedy tokens for the chat the tests send, as the tiny template renders it."""
    path, model = llava
    ids, pixels = llava_inputs(path, f"{PREFIX} <image> {SUFFIX} ", [image])
    return hf_llava_greedy(model, ids, pixels, MAX_TOKENS)


def chat_request(image_bytes: bytes) -> pdserve_pb2.GenerateRequest:
    message = pdserve_pb2.ChatMessage(
        role="user",
        parts=[
            pdserve_pb2.ContentPart(text=PREFIX),
            pdserve_pb2.ContentPart(image=image_bytes),
            pdserve_pb2.ContentPart(text=SUFFIX),
        ],
    )
    return pdserve_pb2.GenerateRequest(
        chat=pdserve_pb2.ChatMessages(messages=[message]),
        sampling=pdserve_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


def http_chat(url: str) -> dict:
    """The chat completion body of the tests' chat, its image at `url` (a data URL or a link)."""
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": PREFIX},
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": SUFFIX},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def assert_keyed_as_the_decode_worker(decode, images, prompt) -> None:
    """The router keys the prompt's two images (PromptImages) as the decode worker's cache
    does, from the pixel values it sends."""
    from pdserve.worker_common.images import pixel_values

    engine_ids = decode.parts["decode"].servicer.loop.engine.cache_ids(
        prompt, pixel_values(images.pixels)
    )
    assert images.keyed(prompt) == engine_ids and len(set(engine_ids) - set(prompt)) == 2


def http_image_chat(router, image) -> list[int]:
    """The tokens of the tests' chat over HTTP with `image` as a base64 data URL."""
    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    status, _, raw = post(router, "/v1/chat/completions", http_chat(url))
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["token_ids"]


def messages_body(router, source: dict) -> dict:
    """The Messages API body of the tests' chat, its image block's source `source`."""
    blocks = [
        {"type": "text", "text": PREFIX},
        {"type": "image", "source": source},
        {"type": "text", "text": SUFFIX},
    ]
    return {
        "model": router.servicer.options.model_id,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "messages": [{"role": "user", "content": blocks}],
    }


def generate(stub, request) -> tuple[list[int], int]:
    """(the tokens, the prompt tokens the cluster took from a prefix cache)."""
    tokens, cached = [], -1
    for event in stub.Generate(request, timeout=120):
        if event.HasField("delta"):
            tokens += list(event.delta.token_ids)
        else:
            cached = event.finish.usage.cached_prompt_tokens
    return tokens, cached


def test_grpc_chats_with_images_give_hf_tokens_and_the_cache_tells_images_apart(llava, cluster):
    router, _, decode, stub = cluster
    a, b, new = random_images(3, seed=3)
    want_a, want_b = hf_tokens(llava, a), hf_tokens(llava, b)
    assert want_a != want_b  # (the image decides this model's tokens, else the test proves little)
    first, _ = generate(stub, chat_request(png(a)))
    assert first == want_a
    other, _ = generate(stub, chat_request(png(b)))  # the same text, another image
    assert other == want_b
    again, cached = generate(stub, chat_request(png(a)))
    assert again == want_a and cached == 32, cached  # the text's block and the image's
    engine = decode.parts["decode"].servicer.loop.engine
    assert engine.scheduler.num_unfinished == 0
    # the router's index hashes the ids the workers' caches do: image A's block is held, and a
    # chat with an image never sent matches the text's block alone
    pool, encoder = router.servicer.pool, router.servicer.encoder
    held = {}
    for name, image in (("a", a), ("new", new)):
        ids, images = encoder.encode_with_images(chat_request(png(image)))
        held[name] = images.keyed(ids)
    wait_until(lambda: max(pool.decode_matches(held["a"]).values(), default=0) >= 32, 10, "A")
    assert max(pool.decode_matches(held["new"]).values(), default=0) == 16


def test_http_chat_with_an_image_url_gives_hf_tokens(llava, cluster):
    router = cluster[0]
    (image,) = random_images(1, seed=4)
    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    status, _, raw = post(router, "/v1/chat/completions", http_chat(url))
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["token_ids"] == hf_tokens(llava, image)


def test_the_responses_and_messages_apis_take_images_too(llava, cluster):
    """OpenAI's Responses API (an input_image part) and Anthropic's Messages API (an image block
    with a base64 source) reach the same chat: HF's tokens, read from their texts."""
    router = cluster[0]
    (image,) = random_images(1, seed=7)
    data = base64.b64encode(png(image)).decode()
    want = hf_tokens(llava, image)
    want = want[: want.index(1)] if 1 in want else want  # (these APIs stop at EOS, "t1")
    tokenizer = router.servicer.tokenizer
    responses = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": PREFIX},
                    {"type": "input_image", "image_url": f"data:image/png;base64,{data}"},
                    {"type": "input_text", "text": SUFFIX},
                ],
            }
        ],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    status, _, raw = post(router, "/v1/responses", responses)
    assert status == 200, raw
    text = json.loads(raw)["output"][-1]["content"][0]["text"]
    source = {"type": "base64", "media_type": "image/png", "data": data}
    status, _, raw = post(router, "/v1/messages", messages_body(router, source))
    assert status == 200, raw
    assert json.loads(raw)["content"][0]["text"] == text
    assert text.strip() == tokenizer.decode(want).strip()  # (a word-level decode: no lead space)


def test_bad_images_are_refused_and_the_cluster_serves_on(llava, cluster):
    _, _, _, stub = cluster
    (image,) = random_images(1, seed=5)
    with pytest.raises(grpc.RpcError) as not_image:
        generate(stub, chat_request(b"GIF89a not really"))
    assert not_image.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not an image file" in not_image.value.details()
    many = chat_request(png(image))
    for _ in range(16):
        many.chat.messages[0].parts.add(image=png(image))
    with pytest.raises(grpc.RpcError) as too_many:
        generate(stub, many)
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 16" in too_many.value.details()
    assert generate(stub, chat_request(png(image)))[0] == hf_tokens(llava, image)


def test_a_deployment_s_image_limit_is_the_router_s(llava, cluster):
    """router.limit_mm_per_prompt (vLLM's --limit-mm-per-prompt): a router that takes one image
    a prompt refuses a chat of two by name and serves one; at 0 it takes none."""
    _, prefill, decode, _ = cluster
    (image,) = random_images(1, seed=5)
    two = chat_request(png(image))
    two.chat.messages[0].parts.add(image=png(image))
    for most in (1, 0):
        router = start_router(llava[0], decode, prefill, max_model_len=256, max_images=most)
        channel = grpc.insecure_channel(router.address)
        try:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                generate(stub, two if most else chat_request(png(image)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {most} are allowed" in refused.value.details()
            assert "limit_mm_per_prompt" in refused.value.details()
            if most:
                assert generate(stub, chat_request(png(image)))[0] == hf_tokens(llava, image)
        finally:
            channel.close()
            router.stop()


def test_a_colocated_decode_worker_runs_the_images_itself(llava):
    """Without a prefill pool the decode worker computes the prompt (Reserve's run_prefill): it
    encodes the images itself, and its prefix cache keys their blocks as a hand-off's."""
    path, _ = llava
    decode = start_decode(path, engine=ENGINE)
    router = start_router(path, decode, colocated=True, max_model_len=256)
    channel = grpc.insecure_channel(router.address)
    try:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        a, b = random_images(2, seed=6)
        for image in (a, b, a):
            assert generate(stub, chat_request(png(image)))[0] == hf_tokens(llava, image)
    finally:
        stop_all([channel], router, decode)


@contextlib.contextmanager
def wide_cluster(path: str):
    """A router (with its HTTP front), a prefill worker and a decode worker on `path`'s model,
    max_model_len 512 (room for several tiled images); yields (router, decode, gRPC stub)."""
    engine = dict(ENGINE, max_model_len=512)
    decode = start_decode(path, engine=engine)
    prefill = start_prefill(path, engine=engine)
    router = start_router(path, decode, prefill, http_port=0, max_model_len=512)
    channel = grpc.insecure_channel(router.address)
    try:
        yield router, decode, pdserve_pb2_grpc.PDServeStub(channel)
    finally:
        stop_all([channel], router, prefill, decode)


# --- LLaVA-NeXT: a count of image tokens that follows each image's size --------------------


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava-next"))
    return path, make_tiny_llava(path, kind="llava-next")


def test_llava_next_chats_give_hf_tokens_and_key_each_image_by_its_own_count(llava_next):
    """Images of two shapes in one chat (88 and 52 image tokens, sent as tiles with the images'
    sizes): HF's tokens over gRPC; the router keys each image's tokens by the processor's count
    of them, as the decode worker's cache does, so the same chat again matches the router's
    index and the decode worker's cache as far as its last full block."""
    path, model = llava_next
    with wide_cluster(path) as (router, decode, stub):
        a, b = random_images(2, seed=8, size=48)
        square, wide = a.resize((40, 40)), b.resize((70, 30))
        request = chat_request(png(square))
        request.chat.messages[0].parts.add(image=png(wide))
        ids, inputs = llava_inputs(
            path, f"{PREFIX} <image> {SUFFIX} <image> ", [square, wide], True
        )
        want = hf_llava_greedy(model, ids, inputs, MAX_TOKENS)
        first, _ = generate(stub, request)
        assert first == want
        again, cached = generate(stub, request)
        assert again == want and cached == len(ids) // 16 * 16, (cached, len(ids))
        encoder = router.servicer.encoder
        prompt, images = encoder.encode_with_images(request)
        assert prompt == ids and images.counts == [88, 52]
        engine_ids = decode.parts["decode"].servicer.loop.engine.cache_ids(ids, inputs)
        assert images.keyed(ids) == engine_ids
        pool = router.servicer.pool
        wait_until(
            lambda: max(pool.decode_matches(engine_ids).values(), default=0) == cached, 10, "held"
        )


# --- Idefics 3 (SmolVLM's class): every image's tiles in one row, with a pixel mask -----------


def test_idefics3_chats_give_hf_tokens_with_one_row_an_image_on_the_wire(tmp_path):
    """The router splits the processor's one row of tiles into one row an image (zero-padded,
    the pixel mask beside them) for the wire: HF's tokens over gRPC and HTTP; each image keyed
    by its own tiles, the same on the router and the decode worker; the same chat again is
    cached to its last full block."""
    path = str(tmp_path / "idefics3")
    model = make_tiny_llava(path, kind="idefics3")
    with wide_cluster(path) as (router, decode, stub):
        a, b = random_images(2, seed=9, size=48)
        square, wide = a.resize((60, 60)), b.resize((70, 30))
        request = chat_request(png(wide))
        request.chat.messages[0].parts.add(image=png(square))
        ids, inputs = llava_inputs(
            path, f"{PREFIX} <image> {SUFFIX} <image> ", [wide, square], True
        )
        want = hf_llava_greedy(model, ids, inputs, MAX_TOKENS)
        assert generate(stub, request)[0] == want
        again, cached = generate(stub, request)
        assert again == want and cached == len(ids) // 16 * 16, (cached, len(ids))
        prompt, images = router.servicer.encoder.encode_with_images(request)
        assert prompt == ids and images.counts == [12, 20]  # 3 tiles and 5, 4 tokens a tile
        assert list(images.pixels.shape[:2]) == [2, 5] and images.pixels.pixel_attention_mask
        assert_keyed_as_the_decode_worker(decode, images, ids)
        one_ids, one = llava_inputs(path, f"{PREFIX} <image> {SUFFIX} ", [wide], True)
        assert http_image_chat(router, wide) == hf_llava_greedy(model, one_ids, one, MAX_TOKENS)


# --- Qwen2-VL and Qwen3-VL: every image's patches in one run, a grid each; 3-D positions ------


@pytest.mark.parametrize("kind", ["qwen2-vl", "qwen3-vl", "qwen3.5-vl"])
def test_qwen_vl_chats_give_hf_tokens_with_each_image_s_grid_on_the_wire(tmp_path, kind):
    """Each image's grid of patches travels beside the patches (worker.PixelValues
    image_grid_thw): HF's tokens over gRPC and HTTP, the decode worker going on from the
    prefill worker's KV at the positions the images shifted (Qwen3-VL's DeepStack features
    added on the prefill worker; Qwen3.5's linear layers' state beside its full layers' KV);
    each image keyed by its own patches and grid, the same on the router and the decode worker;
    the same chat again is cached to its last full block (the hybrid to its prompt's last
    4-token boundary, where its prefill worker kept the state: the decode worker holds its
    first 16-token block, but no state after it, which the router's index knows)."""
    path = str(tmp_path / kind)
    model = make_tiny_qwen2_vl(path, kind=kind)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    with wide_cluster(path) as (router, decode, stub):
        # (the processor the router would load from the directory where torchvision is
        # installed: tests/helpers/vlm.py qwen2_vl_processor)
        router.servicer.encoder.images._processor = qwen2_vl_processor(kind)
        a, b = random_images(2, seed=10, size=48)
        square, wide = a.resize((32, 32)), b.resize((48, 24))
        request = chat_request(png(wide))
        request.chat.messages[0].parts.add(image=png(square))
        text = f"{PREFIX} {image} {SUFFIX} {image} "
        want = hf_qwen2_vl(model, text, [wide, square], MAX_TOKENS, kind)
        assert generate(stub, request)[0] == want
        prompt, images = router.servicer.encoder.encode_with_images(request)
        again, cached = generate(stub, request)
        full = len(prompt) // 16 * 16 if kind != "qwen3.5-vl" else (len(prompt) - 1) // 4 * 4
        assert again == want and cached == full, (cached, len(prompt))
        assert images.counts == [6, 4] and list(images.pixels.image_grid_thw) == [1, 4, 6, 1, 4, 4]
        assert_keyed_as_the_decode_worker(decode, images, prompt)
        one = hf_qwen2_vl(model, f"{PREFIX} {image} {SUFFIX} ", [square], MAX_TOKENS, kind)
        assert http_image_chat(router, square) == one


def test_gemma3_chats_give_hf_tokens_with_images_attended_both_ways(tmp_path):
    """Gemma 3's image tokens attend to one another both ways on the prefill worker, which never
    ends a chunk inside an image (its 8-token budget here is half an image), and the decode worker
    goes on from its KV: HF's tokens (with its bidirectional image mask) over gRPC and HTTP; the
    same chat again is cached to its last full block, inside the second image, and gives them
    again."""
    path = str(tmp_path / "gemma3")
    model = make_tiny_gemma3_vl(path, seed=1)
    engine = dict(ENGINE, max_model_len=512, max_num_batched_tokens=8)
    decode = start_decode(path, engine=engine)
    prefill = start_prefill(path, engine=engine)
    router = start_router(path, decode, prefill, http_port=0, max_model_len=512)
    channel = grpc.insecure_channel(router.address)
    try:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        a, b = random_images(2, seed=11)
        request = chat_request(png(a))
        request.chat.messages[0].parts.add(image=png(b))
        text = f"{PREFIX} <start_of_image> {SUFFIX} <start_of_image> "
        want = hf_gemma3_vl(path, model, text, [a, b], MAX_TOKENS)
        assert generate(stub, request)[0] == want
        prompt, images = router.servicer.encoder.encode_with_images(request)
        again, cached = generate(stub, request)
        image = [i for i, t in enumerate(prompt) if t == GEMMA3_IMAGE_TOKEN_ID]
        assert again == want and cached == len(prompt) // 16 * 16 and image[-1] > cached
        assert images.counts == [16, 16]
        one = hf_gemma3_vl(path, model, f"{PREFIX} <start_of_image> {SUFFIX} ", [b], MAX_TOKENS)
        assert http_image_chat(router, b) == one
    finally:
        stop_all([channel], router, prefill, decode)


def test_a_deployment_s_processor_kwargs_bound_each_image_s_tokens(tmp_path):
    """router.mm_processor_kwargs (vLLM's --mm-processor-kwargs) go to the router's processor
    call: a size that bounds an image to 32x32 pixels gives a 64x64 image 4 tokens, not 16, and
    the chat gets HF's tokens for the prompt the processor makes with them."""
    path = str(tmp_path / "qwen2-vl")
    model = make_tiny_qwen2_vl(path)
    small = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}}
    engine = dict(ENGINE, max_model_len=512)
    decode = start_decode(path, engine=engine)
    prefill = start_prefill(path, engine=engine)
    router = start_router(path, decode, prefill, max_model_len=512, mm_processor_kwargs=small)
    channel = grpc.insecure_channel(router.address)
    try:
        router.servicer.encoder.images._processor = qwen2_vl_processor()
        (image,) = random_images(1, seed=11, size=64)
        request = chat_request(png(image))
        prompt, _ = router.servicer.encoder.encode_with_images(request)
        assert prompt.count(QWEN2_VL_IMAGE_TOKEN_ID) == 4
        text = f"{PREFIX} <|vision_start|><|image_pad|><|vision_end|> {SUFFIX} "
        want = hf_qwen2_vl(model, text, [image], MAX_TOKENS, **small)
        assert generate(pdserve_pb2_grpc.PDServeStub(channel), request)[0] == want
    finally:
        stop_all([channel], router, prefill, decode)


# --- image links, fetched from the hosts a deployment allows (router/openai/media.py) ----------


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /a.png (an image), /big (one byte past an image file's bound),
    /moved (a redirect to /a.png), /slow (a byte every 0.2 s for a minute), /mid (12 MiB,
    its GETs counted), anything else 404; yields (base URL, the image, the counts)."""
    import http.server
    import threading

    from pdserve.protos.limits import MAX_IMAGE_FILE_BYTES

    (image,) = random_images(1, seed=10)
    data = png(image)

    gets = {"/mid": 0}

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path in gets:
                gets[self.path] += 1
            if self.path == "/slow":
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(300):  # (a minute: past the client's 30 s)
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass  # (the router hung up: what the test wants)
                return
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/a.png")
                self.end_headers()
                return
            body = {
                "/a.png": data,
                "/big": b"\0" * (MAX_IMAGE_FILE_BYTES + 1),
                "/mid": b"\0" * (12 << 20),
            }.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", image, gets
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def media_router(llava, cluster):
    """A second router in front of the cluster's workers that fetches image links from
    127.0.0.1 (router.allowed_media_domains)."""
    _, prefill, decode, _ = cluster
    router = start_router(
        llava[0],
        decode,
        prefill,
        http_port=0,
        max_model_len=256,
        http_allowed_media_domains=("127.0.0.1",),
    )
    try:
        yield router
    finally:
        router.stop()


def test_image_links_are_fetched_from_allowed_hosts_only(llava, cluster, image_host, monkeypatch):
    """A router that allows 127.0.0.1 fetches the link and answers as for the same image sent
    as data; a 404, a redirect, a file past the bound and a server that drips past the fetch's
    deadline (1 s here) are 400s naming the link, and the cluster's own router, which allows no
    host, refuses links as before."""
    from pdserve.router.openai import media

    monkeypatch.setattr(media, "FETCH_DEADLINE_S", 1.0)
    base, image, gets = image_host
    with media_router(llava, cluster) as router:
        status, _, raw = post(router, "/v1/chat/completions", http_chat(f"{base}/a.png"))
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["token_ids"] == hf_tokens(llava, image)
        for name, said in (
            ("nothing", "answered 404"),
            ("moved", "a redirect"),
            ("big", "more than the 20 MiB"),
            ("slow", "took more than 1 s"),
        ):
            status, _, raw = post(router, "/v1/chat/completions", http_chat(f"{base}/{name}"))
            message = json.loads(raw)["error"]["message"]
            assert status == 400 and said in message and f"{base}/{name}" in message, raw
        # eight links of 12 MiB, four fetched at a time: a later one starts only as one ends,
        # and only while less than the request's 32 MiB is fetched, so the seventh (after three
        # ends: 36 MiB) and the eighth never start; the fifth and sixth may (they start after
        # one and two ends, unless more have ended by the time they run)
        body = http_chat(f"{base}/mid")
        parts = body["messages"][0]["content"]
        parts[1:2] = [{"type": "image_url", "image_url": {"url": f"{base}/mid"}}] * 8
        status, _, raw = post(router, "/v1/chat/completions", body)
        assert status == 400 and "of image files in a request" in raw.decode(), raw
        assert 4 <= gets["/mid"] <= 6, gets
        other = base.replace("127.0.0.1", "localhost")
        status, _, raw = post(router, "/v1/chat/completions", http_chat(f"{other}/a.png"))
        assert status == 400 and "not from localhost" in raw.decode(), raw
    status, _, raw = post(cluster[0], "/v1/chat/completions", http_chat(f"{base}/a.png"))
    assert status == 400 and "allowed_media_domains is empty" in raw.decode(), raw


def test_responses_messages_and_conversations_take_image_links_too(llava, cluster, image_host):
    """An input_image whose image_url is a link (Responses, and a conversation's items) and an
    image block with a url source (Messages) are fetched as chat's links are: the same tokens
    as the image sent as data. The Responses API and a conversation keep the file fetched, as a
    data URL, not the link; a host not allowed is a 400 naming it in every API."""
    from helpers.http import request

    base, image, _ = image_host
    link = f"{base}/a.png"
    other = base.replace("127.0.0.1", "localhost") + "/a.png"
    want = hf_tokens(llava, image)
    want = want[: want.index(1)] if 1 in want else want  # (these APIs stop at EOS, "t1")
    with media_router(llava, cluster) as router:
        text = router.servicer.tokenizer.decode(want).strip()
        user = {
            "role": "user",
            "content": [
                {"type": "input_text", "text": PREFIX},
                {"type": "input_image", "image_url": link},
                {"type": "input_text", "text": SUFFIX},
            ],
        }
        body = {"input": [user], "max_output_tokens": MAX_TOKENS, "temperature": 0}
        status, _, raw = post(router, "/v1/responses", body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["output"][-1]["content"][0]["text"].strip() == text
        path = f"/v1/responses/{answer['id']}/input_items"
        status, _, raw = request(router.http_address, "GET", path)
        kept = json.loads(raw)["data"][0]["content"][1]["image_url"]
        assert status == 200 and kept.startswith("data:") and link not in kept, raw[:300]
        user["content"][1]["image_url"] = other
        status, _, raw = post(router, "/v1/responses", body)
        assert status == 400 and "not from localhost" in raw.decode(), raw
        user["content"][1]["image_url"] = link
        status, _, raw = post(router, "/v1/conversations", {"items": [user]})
        assert status == 200, raw
        conversation = json.loads(raw)["id"]
        path = f"/v1/conversations/{conversation}/items"
        status, _, raw = request(router.http_address, "GET", path)
        kept = json.loads(raw)["data"][0]["content"][1]["image_url"]
        assert status == 200 and kept.startswith("data:"), raw[:300]
        messages = messages_body(router, {"type": "url", "url": link})
        status, _, raw = post(router, "/v1/messages", messages)
        assert status == 200, raw
        assert json.loads(raw)["content"][0]["text"].strip() == text
        messages["messages"][0]["content"][1]["source"]["url"] = other
        status, _, raw = post(router, "/v1/messages", messages)
        assert status == 400 and "not from localhost" in raw.decode(), raw
