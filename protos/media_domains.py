"""Which hosts a deployment fetches image links from (router.allowed_media_domains, vLLM's
--allowed-media-domains): the check of one listed domain, shared by the deploy config and the
router, and the match of a link's host against the list (router/openai/media.py fetches). Pure
functions; nothing here opens a connection.
"""

from __future__ import annotations

import ipaddress
import re

MAX_MEDIA_DOMAINS = 64
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def check_media_domain(domain: str) -> str:
    """`domain` as the list keeps it: a host name (lowercased) or an IP address; a ValueError
    that says what is wrong otherwise."""
    value = domain.strip().lower()
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if not _HOST.match(value):
        raise ValueError(
            f"an allowed media domain must be a host name such as 'images.example.com' or an IP "
            f"address (no scheme, port or path), got {domain[:80]!r}"
        )
    return value


def media_host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    """Whether a link's host is one of `domains` (each checked by check_media_domain) or a host
    under one ("example.com" takes "img.example.com"); an IP address only as listed."""
    host = host.lower().strip("[]")
    try:
        return str(ipaddress.ip_address(host)) in domains
    except ValueError:
        return any(host == d or host.endswith("." + d) for d in domains)
