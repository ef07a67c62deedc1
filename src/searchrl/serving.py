"""Small JSON-over-HTTP pieces shared by our clients and servers (retrieval, chat completions).

Standard library only: a client call with timeout, retries and exponential back-off, and a quiet request
handler base for ``ThreadingHTTPServer``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from typing import Any

from searchrl.errors import SearchRLError


class ServiceError(SearchRLError, ConnectionError):
    """A server that did not answer, or rejected the request (``status`` set for HTTP errors)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def post_json(url: str, payload: dict[str, Any], timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
              headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    """POST ``payload`` as JSON and return the decoded answer. Connection errors, timeouts and HTTP 5xx are
    retried; HTTP 4xx is not (it will not go away). Header values (API keys) never appear in errors."""
    body = json.dumps(payload).encode()
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
            )
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                raise ServiceError(f"{url} rejected the request: HTTP {exc.code}", status=exc.code) from None
            last = exc
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, json.JSONDecodeError) as exc:
            last = exc
        if attempt < retries:
            time.sleep(backoff * 2**attempt)
    raise ServiceError(f"{url} did not answer after {retries + 1} attempts ({type(last).__name__}: {last})")


class JSONHandler(BaseHTTPRequestHandler):
    """Request handler base: quiet logs, JSON replies and request bodies."""

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet by default
        pass

    def reply(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
