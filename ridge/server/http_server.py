"""uvicorn, set up for ridge: the socket bound first, one log format, the connection guards and
the drain on shutdown.

- Bound first: `ridge serve` binds its port before it loads anything, so a busy port fails in a
  moment with one message, not after the model has loaded.
- One log format: uvicorn gets no logging configuration of its own (log_config=None), so its
  loggers (uvicorn.error, uvicorn.access) propagate to the root handler ridge configures.
- Connection guards (GuardedH11Protocol): uvicorn's h11 protocol times nothing until a first
  response has gone out, so a client that sends half a request line, or half a body, holds its
  socket for as long as it likes. Here a client has `request_read_timeout` seconds to send a
  whole request, from its connection (or, on a kept-alive one, from the next request's first
  byte); then the connection is closed, with a 408 once the headers were read. A request whose
  headers are in is not timed any further, so a long stream the server writes is never cut. Past
  `limit_concurrency` open connections a request gets a 503 in the API's error shape. A request
  h11 cannot parse gets a 400 in that shape (uvicorn's is plain text), and a request head over
  h11's limit (16 KiB) a 431, also when the whole head arrives in one read.
- Drain (RidgeServer): on SIGTERM or Ctrl-C the engine client stops admitting (503, /health
  503), the requests in flight run on for up to `shutdown_timeout` seconds, then each one still
  running ends with an error event and [DONE] (a 503 body if not streamed); only then does
  uvicorn close the connections. A second signal ends the drain at once (the streams still get
  their error events), a third is uvicorn's forced exit. The stop is a clean exit (status 0).
"""
from __future__ import annotations

import functools
import json
import logging
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, STATUS_PHRASES, H11Protocol

from ridge.server.config import ServerConfig
from ridge.server.errors import APIError

log = logging.getLogger("ridge.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# after the drain, the time the streams have to send their last events before uvicorn cancels them
CLOSE_GRACE_S = 5


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now (uvicorn listens on it once the app has started)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _Connection(h11.Connection):
    """h11's connection, keeping the error that ended its parse (h11 hints its status: 431 for a
    head too long). h11 measures a request head only while it is unfinished, so a head that came
    whole in one read (up to 256 KiB) passed: here a parsed head is held to the same limit."""
    error: h11.RemoteProtocolError | None = None

    def __init__(self, head_limit: int):
        super().__init__(h11.SERVER, head_limit)
        self.head_limit = head_limit

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and \
                    len(event.target) + sum(len(k) + len(v) for k, v in event.headers) > self.head_limit:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the request read timeout and an API-shaped connection cap."""

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.header_limit = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(self.header_limit)
        self.read_timeout: float | None = getattr(config, "request_read_timeout", None)
        self.read_timer = None
        self.cap = self.limit_concurrency
        self.limit_concurrency = None       # uvicorn would answer in plain text; _capped answers instead
        if self.cap is not None:
            self.app = functools.partial(self._capped, self.app)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_read()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_read()

    def send_400_response(self, msg: str) -> None:
        """A request h11 could not parse (uvicorn's reply is plain text): the API's error shape,
        431 for a request head over header_limit."""
        e = self.conn.error
        if e is not None and e.error_status_hint == 431:
            err = APIError(431, f"request headers: larger than {self.header_limit} bytes", "headers",
                           "request_header_fields_too_large")
        else:
            err = APIError(400, f"malformed HTTP request: {e or msg}", None, "invalid_http_request")
        self._send_error(err)
        self.transport.close()

    def _send_error(self, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=err.status, headers=headers, reason=STATUS_PHRASES[err.status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_read()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch_read(self) -> None:
        """Armed while a request is partly in: a new connection, headers still coming (h11 holds
        the bytes), a body still coming. Not while the request is in and the response goes out,
        nor on an idle kept-alive connection (uvicorn's keep-alive timeout closes that)."""
        their = self.conn.their_state
        receiving = their is h11.SEND_BODY or (
            their is h11.IDLE and (self.cycle is None or bool(self.conn.trailing_data[0])))
        if not receiving or self.transport.is_closing() or self.read_timeout is None:
            self._disarm()
        elif self.read_timer is None:
            self.read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        who = "%s:%d" % self.client if self.client else "a client"
        log.info("%s did not send its request within %g s: connection closed", who, self.read_timeout)
        cycle = self.cycle
        if self.conn.their_state is h11.SEND_BODY and cycle is not None and not cycle.response_started:
            self._send_error(APIError(408, f"body: not received within {self.read_timeout:g} s", "body",
                                      "request_timeout"))
            # the app waits for the body: it now reads a disconnect, and anything it sends is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    async def _capped(self, app, scope, receive, send) -> None:
        # this connection and this request's task are counted already
        if len(self.connections) > self.cap or len(self.tasks) > self.cap:
            log.warning("over the limit of %d connections: request refused (503)", self.cap)
            err = APIError(503, f"the server is at its limit of {self.cap} connections; retry later", None,
                           "too_many_connections")
            return await err.response({"Connection": "close"})(scope, receive, send)
        await app(scope, receive, send)


class RidgeConfig(uvicorn.Config):
    def __init__(self, app, *, request_read_timeout: float | None = None, **kwargs):
        super().__init__(app, http=GuardedH11Protocol, ws="none", log_config=None, **kwargs)
        self.request_read_timeout = request_read_timeout


class RidgeServer(uvicorn.Server):
    """uvicorn's server with the drain before its own shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, client, shutdown_timeout: float):
        super().__init__(config)
        self.client, self.shutdown_timeout = client, shutdown_timeout
        self.cut = False

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own handler also records the signal to raise it again after the shutdown,
        # which would end a drained, clean stop with SIGTERM's default action: not recorded here
        if not self.should_exit:
            self.should_exit = True
        elif not self.cut:
            self.cut = True
        else:
            self.force_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets is not None:       # uvicorn announces only what it bound itself
            for sock in sockets:
                host, port = sock.getsockname()[:2]
                log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    async def shutdown(self, sockets=None) -> None:
        await self.client.drain(self.shutdown_timeout, cut_short=lambda: self.cut or self.force_exit)
        await super().shutdown(sockets)


def build_server(app, cfg: ServerConfig) -> RidgeServer:
    """The server for `app` (from create_app) with the settings of `cfg`; run it with
    `server.run(sockets=[bind(cfg.host, cfg.port)])`."""
    config = RidgeConfig(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                         timeout_keep_alive=cfg.timeout_keep_alive, limit_concurrency=cfg.limit_concurrency,
                         timeout_graceful_shutdown=CLOSE_GRACE_S, request_read_timeout=cfg.request_read_timeout)
    return RidgeServer(config, app.state.engine_client, cfg.shutdown_timeout)
