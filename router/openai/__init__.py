"""The router's OpenAI-compatible HTTP front, served by uvicorn inside the router process next to
gRPC: every request becomes a call on the router's own gRPC API, so both fronts admit, route,
retry and abort the same way.

    server.py       HttpSettings and HttpFront: the socket, uvicorn's thread, start and stop
    app.py          build_app: the FastAPI app, its error handlers and OpenAPI document
    state.py        what every handler shares, and the checks each request goes through
    connections.py  the connections' bounds: timeouts, the cap, the log rate limit
    status.py, models.py, completions.py, chat.py, tokenize.py
                    the endpoint groups, each an APIRouter
    generate.py     one generation request's gRPC calls and its HTTP response
    protocol.py     the request bodies (with structured outputs and tools) and their gRPC form
    errors.py       OpenAI's error object and the gRPC statuses it maps from
    responses/      OpenAI's responses: whole, streamed, logprobs, tool calls

The router (router/server.py) starts an HttpFront when an HTTP port is configured and stops it
first when it stops.
"""
