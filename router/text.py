"""Prompt encoding and streamed text for the router: the only place it touches the tokenizer.

The decode worker streams token ids; the router turns them into text the same way the engine
does (IncrementalDetokenizer, stop strings cut the text), so a client sees the engine's text.
A chat is rendered with the model's chat template and vLLM's template fields (ChatMessages'
add_generation_prompt, continue_final_message and chat_template_kwargs_json: template_options),
and its tools, tool calls and tool results as router/chat_tools.py says;
the HTTP front's /tokenize uses the same encoder, so it counts what Generate would run.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc

from pdserve.engine.tokenizer import IncrementalDetokenizer, find_stop_string
from pdserve.protos.limits import MAX_PREDICTION_TOKENS
from pdserve.router.chat_tools import chat_conversation
from pdserve.router.images import PromptImages, has_images, parts_as_content


class BadRequest(Exception):
    """A client error with the gRPC status code it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


MAX_CHAT_MESSAGES = 4096
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10  # chat_template_kwargs as JSON
# apply_chat_template's own parameters and the variables it sets: not for chat_template_kwargs
RESERVED_TEMPLATE_KEYS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt "
    "continue_final_message tokenize padding truncation max_length return_tensors return_dict "
    "return_assistant_tokens_mask tokenizer_kwargs sanitize_control_tokens".split()
)


def opens_reasoning(prompt: list[int], tags: tuple[int, int] | None, tokenizer) -> bool:
    """Whether a reasoning model's output starts inside its reasoning: the prompt's last token
    that is not whitespace is <think> (the chat template opened it, as DeepSeek-R1's does).
    Qwen3's template with enable_thinking false ends with an empty, closed block instead."""
    if tags is None:
        return False
    for token in reversed(prompt[-8:]):
        if token == tags[0]:
            return True
        if tokenizer.decode([token]).strip():
            return False
    return False


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token decodes to (a partial character counts as its replacement
    character, which only makes the bound looser)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return max((len(t.encode("utf-8")) for t in texts), default=1) or 1


# The text the tokenizer's thread may have queued at once, in prompts of the largest size a prompt
# may have (PromptEncoder.max_prompt_bytes, in characters): past it a new text is refused
# RESOURCE_EXHAUSTED at once instead of waiting behind seconds of others' tokenizing
MAX_QUEUED_PROMPTS = 4


class PromptEncoder:
    """Turns a request's input into prompt ids, with the work bounded before it starts: a text
    (or chat) longer in bytes than max_model_len tokens of the vocabulary's longest token cannot
    fit and is refused unread; tokenizing runs on one thread of its own, so no gRPC handler holds
    the tokenizer (HF fast tokenizers refuse concurrent encode calls: "Already borrowed"). That
    thread's queue is bounded too: the characters of the texts submitted and not yet done may be
    at most MAX_QUEUED_PROMPTS of the largest prompts, past which a text is refused
    RESOURCE_EXHAUSTED (tokenizing comes before admission, so the admission queue's bound does
    not cover it); one text alone is always taken."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int = 0, images=None):
        self.tokenizer = tokenizer
        # a vision-language model's ChatImages (router/images.py); None: chats of text only
        self.images = images
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # one separator byte per token on top: pre-tokenizers that split on whitespace drop it
        self.max_prompt_bytes = (max_model_len - 1) * (max_token_bytes(tokenizer) + 1)
        self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix="router-tokenize")
        self.max_queued_chars = MAX_QUEUED_PROMPTS * self.max_prompt_bytes
        self.queued_chars = 0  # of the texts submitted to the thread and not yet done
        self._queue_lock = threading.Lock()
        # the first render compiles the chat template (6.5 ms for SmolLM2's): done now, on the
        # tokenizer's thread, so the first client's chat does not wait for it
        self._executor.submit(self._warm_up)
        if images is not None:  # the processor loads on the thread that will use it
            self._executor.submit(images.load)

    def _warm_up(self) -> None:
        conversation = [{"role": "user", "content": "Hello"}]
        try:
            if getattr(self.tokenizer, "chat_template", None):
                self._render_and_encode(conversation, {"add_generation_prompt": True}, False)
            self._encode("Hello", True)
        except Exception:  # a template that wants other roles: its first client compiles it
            pass

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def encode(self, request) -> list[int]:
        """Prompt token ids of a pdserve.v1.GenerateRequest without images; raises BadRequest."""
        ids, images = self.encode_with_images(request)
        if images is not None:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT, "images are taken in Generate's chats only"
            )
        return ids

    def encode_with_images(self, request) -> tuple[list[int], PromptImages | None]:
        """(prompt token ids, the chat's images or None) of a pdserve.v1.GenerateRequest;
        raises BadRequest."""
        kind, images = request.WhichOneof("input"), None
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
        elif kind == "text":
            self._check_size([request.text], "text")
            text = request.text
            # an empty text is refused below even where the tokenizer would give it special
            # tokens (a BOS alone): OpenAI refuses an empty input; /tokenize counts them
            ids = self._run(len(text), self._encode, text, True) if text else []
        elif kind == "chat":
            ids, images = self._encode_chat(request.chat)
        else:
            ids = []
        if request.HasField("truncate_prompt_tokens"):
            if images is not None:  # (the cut could fall inside an image's tokens)
                raise BadRequest(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "truncate_prompt_tokens is not taken with images: leave it unset",
                )
            ids = ids[-self._keep(request.truncate_prompt_tokens) :]
        if not ids:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                "prompt is empty: send text, token ids or chat messages",
            )
        if len(ids) > self.max_model_len - 1:
            raise BadRequest(
                grpc.StatusCode.OUT_OF_RANGE,
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"shorten it to at most {self.max_model_len - 1} tokens",
            )
        if self.vocab_size and max(ids) >= self.vocab_size:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token_ids must be below the vocabulary size {self.vocab_size}, got "
                f"{[t for t in ids if t >= self.vocab_size][:3]}",
            )
        return ids, images

    def with_prediction(self, request):
        """The request's sampling with its text prediction (GenerateRequest.prediction) as
        prediction_token_ids, tokenized without special tokens; the sampling itself when it has
        none. Raises BadRequest for a prediction sent both ways, or one over the bounds."""
        sampling = request.sampling
        if not request.prediction:
            return sampling
        if len(sampling.prediction_token_ids):
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                "send the prediction as text or as sampling.prediction_token_ids, not both",
            )
        self._check_size([request.prediction], "prediction")
        ids = self._run(len(request.prediction), self._encode, request.prediction, False)
        if len(ids) > MAX_PREDICTION_TOKENS:
            raise BadRequest(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the prediction has {len(ids)} tokens; at most {MAX_PREDICTION_TOKENS} are "
                f"allowed: shorten it",
            )
        out = type(sampling)()
        out.CopyFrom(sampling)
        out.prediction_token_ids.extend(ids)
        return out

    def _keep(self, k: int) -> int:
        """How many trailing prompt tokens truncate_prompt_tokens=k keeps (-1: as many as
        max_model_len holds with one left for output)."""
        if k == -1:
            return self.max_model_len - 1
        if k < 1:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"truncate_prompt_tokens={k}: keep k >= 1 of the prompt's last tokens, or -1 for "
                f"as many as max_model_len holds",
            )
        return k

    def _check_size(self, texts: list[str], what: str) -> None:
        """Refuses texts whose UTF-8 is longer than max_prompt_bytes, encoding them only when the
        character count cannot decide (a character is 1 to 4 bytes)."""
        chars = sum(len(t) for t in texts)
        if chars * 4 <= self.max_prompt_bytes:
            return
        counted = chars <= self.max_prompt_bytes
        num = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) if counted else chars
        if num > self.max_prompt_bytes:
            raise BadRequest(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the {what} has {'' if counted else 'at least '}{num} bytes, more "
                f"than max_model_len={self.max_model_len} tokens can hold (at most "
                f"{self.max_prompt_bytes} bytes): shorten it",
            )

    def _run(self, chars: int, fn, *args):
        """fn(*args) on the tokenizer's thread, for a text of `chars` characters (the queue's
        bound, the class docstring)."""
        with self._queue_lock:
            if self.queued_chars and self.queued_chars + chars > self.max_queued_chars:
                raise BadRequest(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the router's tokenizer has {self.queued_chars} characters of other "
                    f"requests' text queued, the most it queues at once: retry shortly",
                )
            self.queued_chars += chars
        try:
            return self._executor.submit(fn, *args).result()
        except RuntimeError as e:  # shut down: the router is stopping
            raise BadRequest(grpc.StatusCode.UNAVAILABLE, f"the router is stopping: {e}") from None
        finally:
            with self._queue_lock:
                self.queued_chars -= chars

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids (POST /tokenize): bounded as a prompt, not checked against the context.
        An empty text is tokenized too, so it gives the tokenizer's special tokens (a BOS) as
        vLLM's /tokenize does."""
        self._check_size([text], "prompt")
        return self._run(len(text), self._encode, text, add_special_tokens)

    def tokenize_whole(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids for a caller that truncates them (Embed's truncate_prompt_tokens): not
        held to max_prompt_bytes, which would refuse the long documents truncation is for; the
        caller's request size bounds the text, and the queue's bound applies."""
        return self._run(len(text), self._encode, text, add_special_tokens)

    def render_pair(self, query: str, document: str) -> str:
        """A scoring pair as the deployment's chat template renders it (vLLM's score template:
        a "query" message, then a "document" message, no generation prompt); the text, which the
        router tokenizes as any text prompt. Raises BadRequest."""
        self._check_size([query, document], "the scoring pair")
        conversation = [
            {"role": "query", "content": query},
            {"role": "document", "content": document},
        ]
        return self._run(len(query) + len(document), self._render_pair_chat, conversation)

    def tokenize_pair(self, query: str, document: str, max_length: int | None = None) -> list[int]:
        """A cross-encoder's scoring pair as one prompt's ids in the tokenizer's own pair
        encoding (text and text_pair), as vLLM encodes a pair for a classifier whose config.json
        leaves use_pad_token true. With `max_length` (truncate_prompt_tokens) the tokenizer cuts
        the pair to that many ids (the longer text first), and the texts are not held to
        max_prompt_bytes, which would refuse the long documents truncation is for. Raises
        BadRequest."""
        if max_length is None:
            self._check_size([query, document], "scoring pair")
        chars = len(query) + len(document)
        return self._run(chars, self._encode_pair, query, document, max_length)

    def _encode_pair(self, query: str, document: str, max_length: int | None) -> list[int]:
        cut = {"truncation": True, "max_length": max_length} if max_length else {}
        try:
            return list(self.tokenizer(text=query, text_pair=document, **cut)["input_ids"])
        except Exception as e:  # e.g. max_length below the pair's own special tokens
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the scoring pair cannot be encoded as a pair by the model's tokenizer: "
                f"{str(e)[:200]}",
            ) from e

    def _render_pair_chat(self, conversation) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=False
            )
        except Exception as e:  # jinja errors: a template that is not a score template
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the scoring pair does not fit the deployment's chat template: {e}",
            ) from e

    def tokenize_chat(self, chat, add_special_tokens: bool = False) -> list[int]:
        """A pdserve.v1.ChatMessages' ids as Generate renders them (POST /tokenize), each image's
        placeholder expanded into its tokens."""
        return self._encode_chat(chat, add_special_tokens)[0]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _encode_chat(self, chat, add_special_tokens: bool = False):
        """(the chat's ids, its PromptImages or None)."""
        messages = chat.messages
        if not messages:
            return [], None
        if len(messages) > MAX_CHAT_MESSAGES:
            raise BadRequest(
                grpc.StatusCode.OUT_OF_RANGE,
                f"chat has {len(messages)} messages; at most {MAX_CHAT_MESSAGES} are allowed",
            )
        texts = [p.text for m in messages for p in m.parts]
        self._check_size([t for m in messages for t in (m.role, m.content, m.reasoning)], "chat")
        self._check_size(texts, "chat")
        with_images = has_images(chat)
        if with_images and self.images is None:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                "this model takes no images (not a vision-language model, or one whose images "
                "are not served yet): send text only",
            )
        if not with_images and any(m.parts for m in messages):
            chat = parts_as_content(chat, BadRequest)
            messages = chat.messages
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                "this model's tokenizer has no chat template: send text or token_ids instead",
            )
        self._check_size([chat.tools_json] + [m.tool_calls_json for m in messages], "chat tools")
        options = template_options(chat)
        conversation, extra = chat_conversation(chat, self.tokenizer.chat_template, BadRequest)
        options.update(extra)
        chars = sum(len(t) for m in messages for t in (m.content, m.reasoning, m.tool_calls_json))
        chars += len(chat.tools_json) + sum(map(len, texts))
        if with_images:
            args = (chat, conversation, options, add_special_tokens)
            return self._run(chars, self._render_with_images, *args)
        args = (conversation, options, add_special_tokens)
        return self._run(chars, self._render_and_encode, *args), None

    def _render(self, conversation, options: dict) -> str:
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        except Exception as e:  # jinja errors: a role or shape the template rejects
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chat messages do not fit the model's chat template: {e}",
            ) from e

    def _render_and_encode(self, conversation, options: dict, add_special_tokens: bool):
        return self._encode(self._render(conversation, options), add_special_tokens)

    def _render_with_images(self, chat, conversation, options: dict, add_special_tokens: bool):
        """On the encoder's thread: a chat with images rendered, its images in the messages as
        the template reads them, then expanded and made pixel values (router/images.py)."""
        template = self.tokenizer.chat_template
        contents, images = self.images.contents(chat, template)
        if len(contents) != len(conversation):  # (tools rewritten into a system message)
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a chat with images cannot carry tools for this model's template: send one or "
                "the other",
            )
        conversation = [{**m, "content": c} for m, c in zip(conversation, contents)]
        rendered = self._render(conversation, options)
        return self.images.encode(rendered, images, add_special_tokens)


def template_options(chat) -> dict:
    """apply_chat_template's keyword arguments from a pdserve.v1.ChatMessages (vLLM's fields:
    add_generation_prompt, default true unless continue_final_message; chat_template_kwargs as
    more template variables); raises BadRequest naming the field."""
    cont = chat.continue_final_message
    gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not cont
    if gen and cont:
        raise BadRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.continue_final_message=true continues the last message: set "
            "chat.add_generation_prompt=false with it (or leave it unset)",
        )
    if cont and chat.messages[-1].role != "assistant":
        raise BadRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.continue_final_message=true continues the last message, which must be the "
            "assistant's",
        )
    options = dict(add_generation_prompt=gen, continue_final_message=cont)
    raw = chat.chat_template_kwargs_json
    if not raw:
        return options
    bad = None
    if len(raw) > MAX_TEMPLATE_KWARGS_BYTES:
        bad = f"has {len(raw)} bytes; at most {MAX_TEMPLATE_KWARGS_BYTES} are allowed"
    else:
        try:
            extra = json.loads(raw)
        except ValueError as e:
            extra, bad = None, f"is not valid JSON: {e}"
        except RecursionError:  # json.loads gives up on deep nesting: the client's, not ours
            extra, bad = None, "nests JSON too deeply: flatten it"
        if bad is None and not isinstance(extra, dict):
            bad = "must be a JSON object (template variable -> value)"
        elif bad is None:
            reserved = sorted(
                k for k in extra if k in RESERVED_TEMPLATE_KEYS or not k.isidentifier()
            )
            if reserved:
                bad = f"sets {[k[:40] for k in reserved[:3]]}, which are not template variables it may set"
    if bad is not None:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"chat.chat_template_kwargs_json {bad}")
    return {**extra, **options}


class TextStream:
    """Incremental text of one sequence. Text that may be the start of a stop string is held
    back until it is clearly not one, so a client never receives text the engine cuts off."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        stops: tuple[str, ...],
        include_stop_str: bool,
    ):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stops = stops
        self.include_stop_str = include_stop_str
        self.num_sent_chars = 0
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text
        # _held_back's state: for each stop string, the longest suffix of the text (as it was
        # `_seen` characters long) that is a proper prefix of it
        self._held = [0] * len(stops)
        self._seen = 0
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def ended_by(self, finish) -> bool:
        """Whether a sequence's finishing event (a TokenDelta-like `finish`: finish_reason,
        stop_reason, token_ids) ended it at a stop token, as the engine's detokenizer tells
        (engine/outputs.py): one of stop_token_ids, or an end-of-sequence token (special: a
        grammar that completed on another token, with no stop reason, is not one)."""
        if finish.finish_reason != "stop" or not finish.token_ids:
            return False
        reason = finish.WhichOneof("stop_reason")
        return reason == "stop_token" or (reason is None and finish.token_ids[-1] in self._special)

    def add(self, token_ids, stop_token: bool = False) -> str:
        """The text now readable after `token_ids`; `stop_token`: the last of them ended the
        sequence as a stop token (an end-of-sequence token or one of stop_token_ids), whose text
        is left out unless include_stop_str_in_output, and searched for no stop string (vLLM
        V1's detokenizer)."""
        last = len(token_ids) - 1 if stop_token else -1
        for k, token_id in enumerate(token_ids):
            if self.stopped:
                break
            if k == last:
                if self.include_stop_str:
                    self.detok.add(token_id)
                break
            delta = self.detok.add(token_id)
            if delta and self.stops:
                hit = find_stop_string(self.detok.text, len(delta), self.stops)
                if hit is not None:
                    i, stop = hit
                    end = i + len(stop) if self.include_stop_str else i
                    self.detok.text = self.detok.text[:end]
                    self.stopped, self.stop_str = True, stop
        text = self.detok.text
        end = len(text) if self.stopped else len(text) - self._held_back(text)
        return self._take(end)

    def flush(self) -> str:
        return self._take(len(self.detok.text))

    def _take(self, end: int) -> str:
        if end <= self.num_sent_chars:
            return ""
        out = self.detok.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return out

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string.

        The text only grows between calls, so a stop string's suffix now is at most its suffix
        at the last call plus the characters added since (drop those and what is left was a
        suffix then). Each stop string is searched only that far back: the work per call is
        the new characters plus what the suffixes shrank by, which adds up to the text's length
        over a sequence, however long the stop strings are."""
        grown = len(text) - self._seen
        if grown < 0:  # not the text of the last call: search it all again
            self._held, grown = [0] * len(self.stops), len(text)
        for k, stop in enumerate(self.stops):
            self._held[k] = stop_prefix_len(text, stop, self._held[k] + grown)
        self._seen = len(text)
        return max(self._held, default=0)


def stop_prefix_len(text: str, stop: str, most: int) -> int:
    """Length of the longest suffix of `text`, `most` characters at most, that is a proper prefix
    of `stop`. Only the positions where `stop`'s first character occurs are compared, from the
    farthest back (the longest suffix) on."""
    start = len(text) - min(most, len(stop) - 1, len(text))
    i = text.find(stop[0], start) if stop else -1
    while i != -1:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0
