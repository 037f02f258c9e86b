"""Images by link on the HTTP front: a chat's image_url parts whose URL is http(s) (and the
Responses API's input_image links and Messages' url sources, which reach it through
`fetch_links`), fetched by the router from the hosts its operator allows
(router.allowed_media_domains, vLLM's --allowed-media-domains), and nothing else.

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


async def fetch_images(messages, domains: tuple[str, ...], indexed: bool = True) -> None:
    """Fills the bytes of every image_url part of `messages` (a chat's) given as a link (a 400
    ApiError naming the part when its link is not allowed or its fetch fails), then checks the
    request's images against its bounds. `indexed`: the chat's messages are the request's own,
    so an error names the message by its index (/v1/messages' chat may have a system message
    of its own first: its errors name the link, or its host, alone)."""
    param = "messages"
    parts = [
        (f"{param}[{i}]" if indexed else param, p)
        for i, m in enumerate(messages or ())
        if not isinstance(m.content, str)
        for p in m.content or ()
        if p.type == "image_url" and p.image_url.link
    ]
    if not parts:
        return
    already = sum(len(image) for m in messages for image in m.images())  # (data URLs' too)
    files = await fetch_links([(w, p.image_url.link) for w, p in parts], domains, already, param)
    for (_, part), data in zip(parts, files):
        part.image_url._image = data
    try:
        check_images(messages)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None


async def fetch_links(
    links: list[tuple[str, str]], domains: tuple[str, ...], already: int, param: str
) -> list[bytes]:
    """The files at `links` ((where in the request, link) each), in order: every link's host
    checked against `domains` before any fetch, then fetched MAX_FETCHES at a time, none once
    the request's image files (`already` bytes before these) pass MAX_REQUEST_IMAGE_BYTES; a 400
    ApiError on `param` naming the place of the first that is not allowed or not fetched."""
    for where, link in links:
        if not domains:
            raise ApiError(
                400,
                f"{where}: an image_url must be a base64 data URL (data:image/png;base64,...): "
                f"this deployment fetches no link (its router.allowed_media_domains is empty)",
                param=param,
                code="invalid_value",
            )
        url = urllib.parse.urlsplit(link)
        if url.username or url.password or not url.hostname:
            raise ApiError(
                400,
                f"{where}: an image link needs a host and no user name or password",
                param=param,
                code="invalid_value",
            )
        if not media_host_allowed(url.hostname, domains):
            raise ApiError(
                400,
                f"{where}: images are fetched from {', '.join(domains[:8])} only, not from "
                f"{url.hostname[:100]} (router.allowed_media_domains)",
                param=param,
                code="invalid_value",
            )

    loop = asyncio.get_running_loop()
    fetched = [already]
    gate = asyncio.Semaphore(MAX_FETCHES)  # this request's fetches start as others end

    async def one(where: str, link: str) -> bytes:
        async with gate:
            if fetched[0] > MAX_REQUEST_IMAGE_BYTES:  # (no more fetches once past the bound)
                raise ApiError(
                    400,
                    f"{param}: at most {MAX_REQUEST_IMAGE_BYTES >> 20} MiB of image files in a "
                    f"request, past which {where}'s link was not fetched",
                    param=param,
                    code="invalid_value",
                )
            try:
                data = await loop.run_in_executor(_POOL, _fetch, link)
            except ValueError as e:
                raise ApiError(
                    400,
                    f"{where}: the image at {link[:200]} was not fetched: {e}",
                    param=param,
                    code="invalid_value",
                ) from None
            fetched[0] += len(data)
            return data

    return list(await asyncio.gather(*(one(where, link) for where, link in links)))
