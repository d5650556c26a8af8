"""HTTP for pd_verify: JSON GET/POST and streamed completions over urllib; every failure is an HttpError."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class HttpError(Exception):
    """An HTTP request failed; ``str()`` says which URL and why."""


def _headers(api_key=None):
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def http_get(url, timeout=10.0, api_key=None):
    """GET url -> (status, body text). Raises HttpError on connection problems."""
    req = urllib.request.Request(url, headers=_headers(api_key), method="GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise HttpError(f"GET {url}: {getattr(e, 'reason', e)}") from e


def http_post_json(url, payload, timeout=600.0, api_key=None):
    """POST JSON -> parsed JSON. Raises HttpError with status and body excerpt when not 200."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers=_headers(api_key), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise HttpError(f"POST {url}: HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:300]}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise HttpError(f"POST {url}: {getattr(e, 'reason', e)}") from e
    try:
        return json.loads(body)
    except ValueError as e:
        raise HttpError(f"POST {url}: response is not JSON: {body[:200]!r}") from e


def stream_completion(url, payload, timeout=600.0, api_key=None, clock=time.perf_counter):
    """POST a streaming completion; returns {ttft_s, e2e_s, output_tokens, text, chunk_times}.

    Output tokens are taken from the final usage block (``stream_options.include_usage``) when the server
    sends it, else counted as non-empty text chunks.
    """
    body = dict(payload, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=_headers(api_key), method="POST")
    start = clock()
    ttft, chunks, text, usage_tokens = None, [], [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if obj.get("usage") and obj["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(obj["usage"]["completion_tokens"])
                for ch in obj.get("choices") or []:
                    piece = ch.get("text")
                    if piece is None:
                        piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        now = clock()
                        if ttft is None:
                            ttft = now - start
                        chunks.append(now)
                        text.append(piece)
    except urllib.error.HTTPError as e:
        raise HttpError(f"POST {url} (stream): HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:300]}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise HttpError(f"POST {url} (stream): {getattr(e, 'reason', e)}") from e
    end = clock()
    if ttft is None:
        raise HttpError(f"POST {url} (stream): no token received")
    return {"ttft_s": ttft, "e2e_s": end - start, "output_tokens": usage_tokens or len(chunks),
            "text": "".join(text)}
