"""One request of pd_load: a greedy completion over a fresh HTTP connection to the router, read within a per-request
deadline and ending in exactly one outcome: completed, or failed with one failure class (FAILURE_CLASSES)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from ansible_collections.b300.pd.bench.pd_load_config import LoadConfig
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify import word_prompt

FAILURE_CLASSES = {
    "http_<code>": "the server answered with an HTTP status other than 200 (http_503, http_500, http_404, ...)",
    "timeout": "no complete answer within --timeout (connect, headers or body; the deadline is per request)",
    "conn_refused": "TCP connection refused (nothing listens: the router or its port is down)",
    "conn_reset": "connection reset or closed before the response was complete (peer died or dropped it)",
    "conn_error": "other network error (no route to host, DNS, ...)",
    "protocol_error": "the answer is not valid HTTP",
    "empty_body": "HTTP 200 with an empty body (or a stream with no event)",
    "bad_body": "HTTP 200 whose body is not a completion: not JSON, an error object, no choices, stream cut "
                "before [DONE]",
    "short_output": "a completion with fewer tokens than --min-output-tokens (usage.completion_tokens; with no "
                    "usage block: an empty text)",
    "unfinished": "still in flight when the grace period after the stop ran out (never dropped silently)",
    "client_error": "an unexpected exception in this client (a bug: see error_samples)",
}

_BODY_EXCERPT = 500  # characters of a failed request's body kept in error_samples


class _Failure(Exception):
    def __init__(self, cls, detail, status=None, body="", retry_after=None):
        super().__init__(detail)
        self.cls, self.detail, self.status, self.body = cls, detail, status, body
        self.retry_after = retry_after


@dataclass
class Outcome:
    ok: bool
    cls: str | None = None
    status: int | None = None
    detail: str = ""
    body: str = ""
    ttft: float | None = None
    tokens: int | None = None
    finish_reason: str | None = None
    has_text: bool = False
    retry_after: str | None = None  # the Retry-After header of a non-200 answer
    prompt_tokens: int | None = None  # usage.prompt_tokens of a completion, when the server sent it


def _remaining(deadline: float) -> float:
    rem = deadline - time.monotonic()
    if rem <= 0:
        raise TimeoutError("per-request deadline passed")
    return rem


def _read1(resp, sock, deadline: float) -> bytes:
    """At most one socket read, bounded by the request deadline (a trickling server cannot stretch it)."""
    sock.settimeout(_remaining(deadline))
    return resp.read1(65536)


def _read_body(resp, sock, deadline: float, limit: int | None = None) -> bytes:
    buf = bytearray()
    while limit is None or len(buf) < limit:
        chunk = _read1(resp, sock, deadline)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _read_error_body(resp, sock, deadline: float) -> bytes:
    """The start of a non-200 answer's body; what arrived before a stall or a reset (the class stays http_<code>)."""
    buf = bytearray()
    try:
        while len(buf) < 4096:
            chunk = _read1(resp, sock, min(deadline, time.monotonic() + 2.0))
            if not chunk:
                break
            buf += chunk
    except (OSError, http.client.HTTPException):
        pass
    return bytes(buf)


def _excerpt(data) -> str:
    if isinstance(data, (bytes, bytearray)):
        data = data.decode("utf-8", "replace")
    return data[:_BODY_EXCERPT]


def _classify(exc: BaseException) -> tuple[str, str]:
    """An exception raised while talking to the server -> (failure class, detail)."""
    detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout", detail
    if isinstance(exc, ConnectionRefusedError):
        return "conn_refused", detail
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.IncompleteRead,
                        http.client.RemoteDisconnected)):
        return "conn_reset", detail
    if isinstance(exc, http.client.HTTPException):
        return "protocol_error", detail
    if isinstance(exc, OSError):
        return "conn_error", detail
    return "client_error", detail


def _choice_text(choice: dict, chat: bool, delta: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    msg = choice.get("delta" if delta else "message") or {}
    # reasoning models (GLM) may put their first tokens in reasoning_content / reasoning, not content
    return msg.get("content") or msg.get("reasoning_content") or msg.get("reasoning") or ""


def _usage_tokens(obj: dict, key: str = "completion_tokens"):
    usage = obj.get("usage") or {}
    tok = usage.get(key) if isinstance(usage, dict) else None
    return tok if isinstance(tok, int) and not isinstance(tok, bool) else None


def request_prompt(words: int, seed: int, i: int) -> str:
    """Request i's prompt in a run seeded `seed`: `words` filler words, a different prompt for every request (the
    capacity search's prompts, bench/capacity_prompts.py, follow the same rule)."""
    return word_prompt(words, seed * 1_000_003 + i)


class CompletionClient:
    """Sends request number i of a run to the router (its URL, endpoint and options from the LoadConfig) and returns
    its Outcome; every exception is a classified failure."""

    def __init__(self, cfg: LoadConfig):
        self.cfg = cfg
        parts = urlsplit(cfg.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        self._chat = cfg.endpoint == "chat"
        self._path = prefix + ("/v1/chat/completions" if self._chat else "/v1/completions")

    @property
    def path(self) -> str:
        return self._path

    def _payload(self, i: int) -> bytes:
        cfg = self.cfg
        prompt = request_prompt(cfg.prompt_words, cfg.seed, i)
        body: dict = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": 0.0}
        if self._chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if cfg.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = cfg.max_tokens
        if cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode()

    def _headers(self, request_id: str) -> dict:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream" if self.cfg.stream else
             "application/json", "Connection": "close", "User-Agent": "pd_load/1", "X-Request-Id": request_id}
        if self.cfg.api_key:
            h["Authorization"] = f"Bearer {self.cfg.api_key}"
        return h

    def send(self, i: int, request_id: str, on_socket) -> Outcome:
        """Request number i (its prompt seed), sent with X-Request-Id request_id; on_socket(sock) gets the
        connected socket (a stop can shut it to abandon the request)."""
        cfg = self.cfg
        payload = self._payload(i)
        start = time.monotonic()
        deadline = start + cfg.timeout
        conn_cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_cls(self._host, self._port, timeout=cfg.timeout)
        try:
            conn.connect()
            sock = conn.sock  # kept: http.client drops conn.sock once a Connection: close answer arrives
            on_socket(sock)
            sock.settimeout(_remaining(deadline))
            conn.request("POST", self._path, body=payload, headers=self._headers(request_id))
            sock.settimeout(_remaining(deadline))
            resp = conn.getresponse()
            if resp.status != 200:
                retry_after = resp.getheader("Retry-After")
                body = _read_error_body(resp, sock, deadline)
                raise _Failure(f"http_{resp.status}", f"HTTP {resp.status} {resp.reason}", resp.status,
                               _excerpt(body), retry_after)
            if cfg.stream:
                out = self._read_stream(resp, sock, deadline, start)
            else:
                out = self._parse_json(_read_body(resp, sock, deadline))
            self._check_output(out)
            return out
        except _Failure as f:
            # a body failure is raised after an HTTP 200
            return Outcome(False, f.cls, f.status if f.status is not None else 200, f.detail, f.body,
                           retry_after=f.retry_after)
        except Exception as e:  # noqa: BLE001 - every exception is a classified failure
            cls, detail = _classify(e)
            return Outcome(False, cls, detail=detail)
        finally:
            conn.close()

    def _parse_json(self, body: bytes) -> Outcome:
        if not body.strip():
            raise _Failure("empty_body", "HTTP 200 with an empty body")
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise _Failure("bad_body", f"body is not JSON: {e}", body=_excerpt(body)) from e
        if not isinstance(obj, dict) or obj.get("error") is not None:
            raise _Failure("bad_body", "body is an error object, not a completion", body=_excerpt(body))
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _Failure("bad_body", "body has no choices", body=_excerpt(body))
        text = _choice_text(choices[0], self._chat, delta=False)
        return Outcome(True, tokens=_usage_tokens(obj), finish_reason=choices[0].get("finish_reason"),
                       has_text=bool(text), prompt_tokens=_usage_tokens(obj, "prompt_tokens"))

    def _read_stream(self, resp, sock, deadline: float, start: float) -> Outcome:
        """SSE: data: {...} events until data: [DONE]; TTFT = first event with text."""
        buf = b""
        head = b""
        raw_bytes = 0
        events = 0
        ttft = None
        tokens = None
        prompt_tokens = None
        finish = None
        text_len = 0
        done = False
        eof = False
        while not done and not eof:
            chunk = _read1(resp, sock, deadline)
            if not chunk:
                eof = True
                chunk = b"\n"  # flush a last line without newline
            else:
                raw_bytes += len(chunk)
                if len(head) < _BODY_EXCERPT:
                    head += chunk[:_BODY_EXCERPT - len(head)]
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                events += 1
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except ValueError as e:
                    raise _Failure("bad_body", f"stream event {events} is not JSON: {e}", body=_excerpt(data)) from e
                if not isinstance(obj, dict) or obj.get("error") is not None:
                    raise _Failure("bad_body", f"stream event {events} is an error", body=_excerpt(data))
                if _usage_tokens(obj) is not None:
                    tokens = _usage_tokens(obj)
                if _usage_tokens(obj, "prompt_tokens") is not None:
                    prompt_tokens = _usage_tokens(obj, "prompt_tokens")
                for ch in obj.get("choices") or []:
                    if not isinstance(ch, dict):
                        continue
                    piece = _choice_text(ch, self._chat, delta=True)
                    if piece:
                        text_len += len(piece)
                        if ttft is None:
                            ttft = time.monotonic() - start
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
        if not done:
            if raw_bytes == 0:
                raise _Failure("empty_body", "HTTP 200 stream closed with no byte")
            if events == 0:
                raise _Failure("bad_body", "HTTP 200 stream with no data: event", body=_excerpt(head))
            raise _Failure("bad_body", f"stream ended after {events} events without data: [DONE]")
        return Outcome(True, ttft=ttft, tokens=tokens, finish_reason=finish, has_text=text_len > 0,
                       prompt_tokens=prompt_tokens)

    def _check_output(self, out: Outcome) -> None:
        want = self.cfg.min_tokens_expected
        if out.tokens is not None:
            if out.tokens < want:
                raise _Failure("short_output", f"{out.tokens} completion tokens, expected >= {want} "
                               f"(finish_reason {out.finish_reason})")
        elif want > 0 and not out.has_text:
            raise _Failure("short_output", f"empty text and no usage block (finish_reason {out.finish_reason})")
