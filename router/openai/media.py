"""Images by link on the HTTP front: a chat's image_url parts whose URL is http(s), fetched by the
router from the hosts its operator allows (router.allowed_media_domains, vLLM's
--allowed-media-domains), and nothing else.

A stranger's link makes the router open a connection, so fetching is off unless the deployment
lists domains: a link is then a 400 that says so, as before. With a list, a link's host must be
one of its domains or under one ("example.com" takes "img.example.com"; an IP address only as
listed), and the URL http or https with no user name or password in it. Each fetch runs on a
thread of its own pool (never the event loop, and never the threads that parse bodies), at most
MAX_FETCHES at once for the whole router, within FETCH_TIMEOUT_S to connect and between reads
and FETCH_DEADLINE_S in all, follows no redirect (a redirect could lead anywhere), and reads at
most MAX_IMAGE_FILE_BYTES; a request's files then count toward its bounds as data URLs' do
(protocol.py check_images), and once they pass MAX_REQUEST_IMAGE_BYTES no further link of it is
fetched (the fetches already in flight, MAX_FETCHES at most, finish). `fetch_images` fills each part's bytes before the chat becomes a
gRPC request; whether the bytes are an image is the router encoder's check, as for data URLs.
Nothing is cached: the same link in two requests is fetched twice.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pdserve.protos.limits import MAX_IMAGE_FILE_BYTES, MAX_REQUEST_IMAGE_BYTES
from pdserve.protos.media_domains import media_host_allowed
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import check_images

MAX_FETCHES = 4  # fetches in flight in one router; more wait their turn
FETCH_TIMEOUT_S = 10.0  # to connect, and between two reads of the body
FETCH_DEADLINE_S = 30.0  # a whole fetch, however its server drips
_POOL = ThreadPoolExecutor(MAX_FETCHES, thread_name_prefix="pdserve-media")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(
            req.full_url,
            code,
            f"a redirect (to {newurl[:200]}), which is not followed",
            headers,
            fp,
        )


_OPENER = urllib.request.build_opener(_NoRedirect)


def _fetch(url: str) -> bytes:
    """The file at `url`, or a ValueError that says why not (its status, a timeout, its size)."""
    request = urllib.request.Request(url, headers={"User-Agent": "pdserve"})
    deadline = time.monotonic() + FETCH_DEADLINE_S
    try:
        with _OPENER.open(request, timeout=FETCH_TIMEOUT_S) as response:
            chunks, size = [], 0
            while size <= MAX_IMAGE_FILE_BYTES:
                if time.monotonic() > deadline:
                    raise ValueError(f"it took more than {FETCH_DEADLINE_S:.0f} s")
                chunk = response.read1(1 << 16)  # (one read of the socket: the deadline holds)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            data = b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise ValueError(f"the server answered {e.code} ({str(e.reason)[:200]})") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"it could not be read ({str(reason)[:200]})") from None
    if len(data) > MAX_IMAGE_FILE_BYTES:
        raise ValueError(
            f"it is more than the {MAX_IMAGE_FILE_BYTES >> 20} MiB an image file may hold"
        )
    if not data:
        raise ValueError("it is empty")
    return data


async def fetch_images(messages, domains: tuple[str, ...]) -> None:
    """Fills the bytes of every image_url part of `messages` given as a link (a 400 ApiError
    naming the part when its link is not allowed or its fetch fails), then checks the request's
    images against its bounds."""
    parts = [
        (i, p)
        for i, m in enumerate(messages or ())
        if not isinstance(m.content, str)
        for p in m.content or ()
        if p.type == "image_url" and p.image_url.link
    ]
    if not parts:
        return
    for i, part in parts:
        link = part.image_url.link
        where = f"messages[{i}]"
        if not domains:
            raise ApiError(
                400,
                f"{where}: an image_url must be a base64 data URL (data:image/png;base64,...): "
                f"this deployment fetches no link (its router.allowed_media_domains is empty)",
                param="messages",
                code="invalid_value",
            )
        url = urllib.parse.urlsplit(link)
        if url.username or url.password or not url.hostname:
            raise ApiError(
                400,
                f"{where}: an image link needs a host and no user name or password",
                param="messages",
                code="invalid_value",
            )
        if not media_host_allowed(url.hostname, domains):
            raise ApiError(
                400,
                f"{where}: images are fetched from {', '.join(domains[:8])} only, not from "
                f"{url.hostname[:100]} (router.allowed_media_domains)",
                param="messages",
                code="invalid_value",
            )

    loop = asyncio.get_running_loop()
    fetched = [sum(len(image) for m in messages for image in m.images())]  # (data URLs' too)
    gate = asyncio.Semaphore(MAX_FETCHES)  # this request's fetches start as others end

    async def one(i, part):
        async with gate:
            if fetched[0] > MAX_REQUEST_IMAGE_BYTES:  # (no more fetches once past the bound)
                raise ApiError(
                    400,
                    f"messages: at most {MAX_REQUEST_IMAGE_BYTES >> 20} MiB of image files in a "
                    f"request, past which messages[{i}]'s link was not fetched",
                    param="messages",
                    code="invalid_value",
                )
            link = part.image_url.link
            try:
                part.image_url._image = await loop.run_in_executor(_POOL, _fetch, link)
            except ValueError as e:
                raise ApiError(
                    400,
                    f"messages[{i}]: the image at {link[:200]} was not fetched: {e}",
                    param="messages",
                    code="invalid_value",
                ) from None
            fetched[0] += len(part.image_url._image)

    await asyncio.gather(*(one(i, p) for i, p in parts))
    try:
        check_images(messages)
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages", code="invalid_value") from None
