"""Client-facing error messages carry no internal addresses.

A GatewayError's message may name the worker or KV endpoint that failed (the gateway's own
logs want that). Before it reaches a client (gRPC status details, OpenAI error JSON, an SSE
error event), every known worker address and anything shaped like an address (URL,
IPv4/IPv6 host:port) becomes "<internal>"; the full message is logged with the client's
request id so an operator can still find it.
"""
from __future__ import annotations

import logging
import re

from .request import GatewayError

log = logging.getLogger(__name__)

HIDDEN = "<internal>"
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;)]+"            # ucx://host:port, http://...
                      r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"                 # [ipv6]:port
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")       # ipv4[:port]


def redact(message: str, known: list[str] = ()) -> str:
    for address in sorted(known, key=len, reverse=True):
        if address:
            message = message.replace(address, HIDDEN)
    return _ADDRESS.sub(HIDDEN, message)


def public_message(e: GatewayError, request_id: str, known: list[str] = ()) -> str:
    """`e`'s message fit for the client; logs the full one (with `request_id`) if it differs."""
    public = redact(e.message, known)
    if public != e.message:
        log.warning("request %s failed (%s): %s", request_id, e.code.name, e.message)
    return public
