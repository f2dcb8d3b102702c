"""The OpenAI-compatible HTTP front: a process of its own, a client of the ZeroMQ daemon.

Users come with the OpenAI SDK, chat UIs and load testers; this front serves them
`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health` (Starlette on
uvicorn) and turns each generation into one `generate` request to the daemon, over the
same ZeroMQ protocol and code path as every other client. There is no second engine loop:
the daemon schedules the front's requests with everyone else's.

Why a process of its own: JSON parsing, server-sent events and HTTP itself are Python work
that would hold the engine process's GIL, and that process's threads (the I/O thread,
the prompt thread, the engine thread that issues every step) need it between steps; a
busy HTTP front in the same process would stretch the time between decode steps. In a
separate process it costs the engine nothing but the ZeroMQ messages, which it already
handles for every client; it is the split vLLM makes between its API server and its
engine core. It also lets the front run, restart or scale apart from the daemon, on
another host over CURVE. `rocforge serve --http HOST:PORT` starts it as a child process
once the daemon is ready and stops it with the daemon (server/front_process.py);
`rocforge http` runs it alone.

Modules, each importing only those above it in this list (and server/ below):

- `errors.py`: errors in OpenAI's shape; the daemon's error codes as HTTP statuses.
- `daemon_link.py`: `DaemonLink`, one asyncio DEALER socket carrying many requests at
  once (multiplexed by request id, a queue each), aborts, the connection's state.
- `openai_requests.py`: OpenAI request bodies checked, as `generate` fields (`Generation`).
- `openai_replies.py`: the daemon's token replies as completions and chunks (finish
  reasons, usage, logprobs).
- `middleware.py`: a log line per request (`RequestLog`), the Host check (421), CORS, the
  API key check.
- `transport.py`: the connections, bounded (uvicorn's h11 protocol subclassed: request
  head timeout 408 and size 431, a connection cap evicting the oldest head-reading one,
  half-closed clients answered, accept errors logged once), and uvicorn's settings.
- `app.py`: the Starlette app (routes, server-sent events, client disconnects).
- `command.py`: `rocforge http` and `python -m rocforge_rt.server.http` (options, the
  listen check, serving).
"""
