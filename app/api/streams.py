"""An events stream served to the end of its connection: a client that goes away is no error.

FastAPI serves a generator route as Server-Sent Events through a task that hands each event on
to the response, and closes the response's side first when the response ends. A client that
disconnects while that task waits to hand on an event (a stream replaying its history, say)
leaves it an ``anyio.BrokenResourceError``, which would reach the server as an "Exception in ASGI
application" with its traceback. Once the client has gone away that error says nothing more than
the disconnect itself.
"""

from __future__ import annotations

import logging

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("muonforge.api")
PEER_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError)


async def serve_stream(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """``app`` serving one stream; the errors of its teardown after a disconnect logged, not raised."""
    disconnected = False

    async def watched() -> Message:
        nonlocal disconnected
        message = await receive()
        disconnected = disconnected or message["type"] == "http.disconnect"
        return message

    try:
        await app(scope, watched, send)
    except* PEER_GONE:
        if not disconnected:
            raise
        log.debug("%s: the client went away", scope["path"])
