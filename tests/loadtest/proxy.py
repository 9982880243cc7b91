"""A corrupting proxy for the corruption check's own test: forwards everything to a real server
on 127.0.0.1 and alters one content token of exactly one streamed chat response (the Nth)."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one response per connection, body ends at close: no chunking

    def log_message(self, *_):  # quiet
        pass

    def do_GET(self):
        self._forward(None)

    def do_POST(self):
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _forward(self, body: bytes | None) -> None:
        srv = self.server
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "x-session-id")}
        target = False
        if body is not None and self.path.endswith("/chat/completions"):
            with srv.lock:
                srv.chats += 1
                target = srv.chats == srv.corrupt_nth
        with httpx.stream(self.command, srv.upstream + self.path, content=body, headers=headers,
                          timeout=300) as r:
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() in ("content-type", "x-session-id", "x-fedserve-replica"):
                    self.send_header(k, v)
            self.end_headers()
            seen = 0
            for line in r.iter_lines():
                if target and line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    for ch in ev.get("choices") or []:
                        if (ch.get("delta") or {}).get("content"):
                            seen += 1
                            if seen == 2:  # the second content token becomes something else
                                ch["delta"]["content"] = " ZZZ"
                                srv.corrupted += 1
                    line = "data: " + json.dumps(ev)
                self.wfile.write((line + "\n").encode())
                self.wfile.flush()


@contextmanager
def corrupting_proxy(upstream: str, corrupt_nth: int):
    """Serve on a free 127.0.0.1 port; yields the server (its .url, .corrupted count)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.upstream, srv.corrupt_nth, srv.chats, srv.corrupted = upstream, corrupt_nth, 0, 0
    srv.lock = threading.Lock()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
