"""A scripted OpenAI-compatible judge for tests: a real HTTP server on 127.0.0.1 (the standard library's threading
server) answering `GET /v1/models` and `POST /v1/chat/completions`.

Its reply is scripted by the message it gets: the text after the last `REPLY:` up to the end of that line is the
judge's reply (else "yes"); `SLEEP:<seconds>` delays the answer, `STATUS:<code>` answers that HTTP status,
`GARBAGE` answers a body that is not JSON. It records every request (`requests`: path, headers, body) and the most
requests it served at once (`peak`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    server: "FakeJudge"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.record(self.path, dict(self.headers), {})
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-judge", "object": "model"}]}).encode())
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.server.record(self.path, dict(self.headers), body)
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._send(404, b'{"error": {"message": "not found"}}')
        with self.server.active():
            text = body["messages"][-1]["content"]
            sleep = re.findall(r"SLEEP:([\d.]+)", text)
            if sleep:
                time.sleep(float(sleep[-1]))
            status = re.findall(r"STATUS:(\d+)", text)
            if status:
                return self._send(int(status[-1]), b'{"error": {"message": "scripted failure"}}')
            if "GARBAGE" in text:
                return self._send(200, b"<html>not json</html>", "text/html")
            replies = re.findall(r"REPLY:(.*)", text)
            reply = replies[-1].strip() if replies else "yes"
            out = {"id": "x", "object": "chat.completion", "model": body.get("model"),
                   "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": reply}}]}
            self._send(200, json.dumps(out).encode())


class FakeJudge(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict] = []
        self.peak = 0
        self._busy = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def record(self, path: str, headers: dict, body: dict) -> None:
        with self._lock:
            self.requests.append({"path": path, "headers": headers, "body": body, "t": time.monotonic()})

    def active(self):
        server = self

        class _Active:
            def __enter__(self):
                with server._lock:
                    server._busy += 1
                    server.peak = max(server.peak, server._busy)

            def __exit__(self, *exc):
                with server._lock:
                    server._busy -= 1

        return _Active()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.peak = 0

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
