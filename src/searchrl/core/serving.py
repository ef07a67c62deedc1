"""Small JSON-over-HTTP pieces shared by our clients and servers (retrieval, chat completions).

Standard library only: a client call with timeout, retries and exponential back-off, and the failure
counters of the judge and summarizer clients. The servers themselves are in `searchrl.core.asgi`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping
from typing import Any

from searchrl.core.aggregate import Sum
from searchrl.core.errors import SearchRLError


class ServiceError(SearchRLError, ConnectionError):
    """A server that did not answer, or rejected the request (``status`` set for HTTP errors)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


MAX_BACKOFF_S = 15.0  # the longest wait between two attempts (the doubling stops there)


def post_json(
    url: str,
    payload: dict[str, Any],
    timeout: float = 30.0,
    retries: int = 3,
    backoff: float = 0.5,
    headers: dict[str, str] | None = None,
) -> Any:
    """POST ``payload`` as JSON and return the decoded answer. Connection errors, timeouts and HTTP 5xx are
    retried; HTTP 4xx is not (it will not go away). Header values (API keys) never appear in errors."""
    body = json.dumps(payload).encode()
    secrets = list((headers or {}).values())
    try:
        return _post(url, body, timeout, retries, backoff, headers)
    except ServiceError as exc:  # whatever the server echoed: no key, no Authorization value
        raise ServiceError(redact(str(exc), secrets), status=exc.status) from None


def _post(
    url: str, body: bytes, timeout: float, retries: int, backoff: float, headers: dict[str, str] | None
) -> Any:
    last: Exception | None = None
    status: int | None = None
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
            )
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            status, reason = exc.code, _reason(exc)
            if exc.code < 500:
                raise ServiceError(
                    f"{url} rejected the request: HTTP {exc.code}{reason}", status=exc.code
                ) from None
            last = ServiceError(f"HTTP {exc.code}{reason}", status=exc.code)
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, json.JSONDecodeError) as exc:
            last, status = exc, None
        if attempt < retries:
            time.sleep(min(backoff * 2**attempt, MAX_BACKOFF_S))
    what = str(last) if isinstance(last, ServiceError) else f"{type(last).__name__}: {last}"
    raise ServiceError(f"{url} did not answer after {retries + 1} attempts ({what})", status=status)


_KEYLIKE = re.compile(r"\b(sk-|sk_|rk-|hf_|ghp_|gho_|github_pat_|xox[abpr]-|AKIA|AIza)[A-Za-z0-9_\-]{8,}")
_BEARER = re.compile(r"(Bearer|Basic|Token)\s+[^\s\"',;}]+", re.I)
_KEY_FIELD = re.compile(
    r"((?:api[_-]?key|authorization|access_token|token|key)[\"']?\s*[:=]\s*[\"']?)[^\s\"'&,;}]+", re.I
)


def redact(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """``text`` (an error body, a log line) without the given ``secrets`` (header values: the key and its
    ``Bearer`` form) and without anything shaped like a key, an Authorization value or a ``key=`` field:
    an endpoint that echoes the request's key must not make us print it."""
    for secret in sorted((x for x in secrets if x), key=len, reverse=True):
        text = text.replace(secret, "[redacted]")
        if secret.lower().startswith("bearer "):
            text = text.replace(secret[7:].strip(), "[redacted]")
    text = _BEARER.sub(lambda m: f"{m.group(1)} [redacted]", text)
    text = _KEYLIKE.sub("[redacted]", text)
    return _KEY_FIELD.sub(lambda m: f"{m.group(1)}[redacted]", text)


def _reason(exc: urllib.error.HTTPError) -> str:
    """The server's own explanation of an HTTP error (``{"error": …}`` bodies, OpenAI's included)."""
    try:
        data = json.loads(exc.read()[:4096])
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message", err) if isinstance(err, dict) else err
        return f" ({str(msg)[:300]})" if msg else f" ({exc.reason})"
    except Exception:
        return f" ({exc.reason})" if exc.reason else ""


class ServiceFailure(SearchRLError):
    """A judge or summarizer endpoint failing more often than its ``max_failure_rate``."""


class FailureCounter:
    """Requests and failures of one client of a service (a judge, a summarizer), thread-safe. Every counter
    is listed in `COUNTERS`; the trainer logs them per step (``service/<name>/requests``, ``…/failures``)
    and stops the run, on every process together, when a service fails too often."""

    def __init__(self, name: str, endpoint: str, max_rate: float = 0.05, min_requests: int = 20) -> None:
        if not 0.0 <= max_rate <= 1.0:
            raise SearchRLError(f"{name}: max_failure_rate must be in [0, 1], got {max_rate}")
        self.name, self.endpoint, self.max_rate, self.min_requests = name, endpoint, max_rate, min_requests
        self.requests = self.failures = 0
        self.last_error = ""
        self._logged = (0, 0)
        self._lock = threading.Lock()
        COUNTERS.add(self)

    def record(self, error: str | None = None) -> None:
        with self._lock:
            self.requests += 1
            if error is not None:
                self.failures += 1
                self.last_error = error

    def reject(self, error: str) -> None:
        """A request already recorded as answered turned out unusable (a judge reply with no score)."""
        with self._lock:
            self.failures += 1
            self.last_error = error

    def delta(self) -> tuple[int, int]:
        """(requests, failures) since the last call."""
        with self._lock:
            now = (self.requests, self.failures)
            d, self._logged = (now[0] - self._logged[0], now[1] - self._logged[1]), now
            return d


# the counters of live clients (a client that is garbage-collected leaves)
COUNTERS: weakref.WeakSet[FailureCounter] = weakref.WeakSet()


def service_metrics() -> dict[str, Sum]:
    """Requests and failures of every service since the last call, as summable metrics."""
    out: dict[str, Sum] = {}
    for c in COUNTERS:
        req, fail = c.delta()
        for key, v in ((f"service/{c.name}/requests", req), (f"service/{c.name}/failures", fail)):
            out[key] = Sum(out.get(key, 0.0) + v)
    return out


def check_failure_rates(totals: Mapping[str, float]) -> None:
    """Raise `ServiceFailure` when a service's failures over its requests (``totals``: the summed
    ``service/<name>/…`` metrics, equal on every process) exceed its ``max_failure_rate``."""
    for name in {k.split("/")[1] for k in totals if k.startswith("service/")}:
        req, fail = totals.get(f"service/{name}/requests", 0.0), totals.get(f"service/{name}/failures", 0.0)
        mine = [c for c in COUNTERS if c.name == name]
        if not mine or not fail:
            continue
        max_rate, min_req = min(c.max_rate for c in mine), min(c.min_requests for c in mine)
        if fail > max_rate * req and (req >= min_req or fail >= req):  # every request failing: at once
            worst = max(mine, key=lambda c: c.failures)
            last = worst.last_error or "(the failures were on another process)"
            raise ServiceFailure(
                f"{name}: {fail:.0f} of {req:.0f} requests to {worst.endpoint} failed ({fail / req:.0%}, "
                f"above max_failure_rate {max_rate:.0%}); the last error: {last}. Check the endpoint, its "
                f"model name and the API key's environment variable (its value is never shown)"
            )


def failure_summary() -> list[str]:
    """One line per service that was called: requests, failures, rate."""
    seen: dict[str, list[int]] = {}
    for c in COUNTERS:
        s = seen.setdefault(f"{c.name} ({c.endpoint})", [0, 0])
        s[0] += c.requests
        s[1] += c.failures
    return [f"{k}: {r} requests, {f} failed ({f / r:.1%})" for k, (r, f) in seen.items() if r]
