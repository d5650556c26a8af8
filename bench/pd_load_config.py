"""Settings of a pd_load run (LoadConfig: the CLI's options; validate() names every bad field and the fix) and
where the bench tools' client key comes from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """Bad load-generator settings; the message names every bad field and the fix."""


@dataclass
class LoadConfig:
    """Settings of one run; field names are the CLI's long options with '-' -> '_'."""

    url: str = ""
    model: str = ""
    endpoint: str = "completions"  # completions | chat
    max_tokens: int = 16
    prompt_words: int = 64
    concurrency: int | None = None  # closed-loop workers; with rate: the cap on requests in flight
    rate: float | None = None  # requests per second (open loop)
    duration: float | None = None  # seconds; None or 0: until stop()/signal/stop file/max_requests
    max_requests: int | None = None
    timeout: float = 60.0  # per request, connect to last byte
    grace: float | None = None  # wait for in-flight after the stop; None: timeout + 5
    stream: bool = False
    ignore_eos: bool = True  # ignore_eos + min_tokens = max_tokens: every completion has max_tokens tokens
    min_output_tokens: int | None = None  # None: max_tokens with ignore_eos, else 1
    api_key: str | None = None
    stop_file: str | None = None
    seed: int = 0
    error_samples: int = 3  # kept per failure class
    bucket: float = 1.0  # timeline bucket width, seconds
    max_failed: int = 0
    min_completed: int = 1

    @property
    def workers(self) -> int:
        if self.concurrency:
            return self.concurrency
        return 64 if self.rate else 4

    @property
    def grace_s(self) -> float:
        return self.timeout + 5.0 if self.grace is None else self.grace

    @property
    def min_tokens_expected(self) -> int:
        if self.min_output_tokens is not None:
            return self.min_output_tokens
        return self.max_tokens if self.ignore_eos else 1

    def validate(self) -> None:
        """Raise ConfigError naming every bad field and the fix."""
        errs = []
        parts = urlsplit(self.url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            errs.append(f"url '{self.url}': need http://HOST:PORT (the router, e.g. http://10.237.0.13:8000)")
        else:
            try:
                parts.port  # noqa: B018 - raises ValueError on a bad port
            except ValueError:
                errs.append(f"url '{self.url}': the port is not a number in 1-65535")
        if not self.model:
            errs.append("model: empty; give the served model name (pd_served_model_name, e.g. tiny-pd)")
        if self.endpoint not in ("completions", "chat"):
            errs.append(f"endpoint '{self.endpoint}': use completions or chat")
        for name in ("max_tokens", "prompt_words"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                errs.append(f"{name} {getattr(self, name)!r}: must be an integer >= 1")
        if self.concurrency is not None and (not isinstance(self.concurrency, int) or self.concurrency < 1):
            errs.append(f"concurrency {self.concurrency!r}: must be an integer >= 1")
        if self.rate is not None and not self.rate > 0:
            errs.append(f"rate {self.rate!r}: must be > 0 requests per second (leave it out for a closed loop)")
        if self.duration is not None and not self.duration >= 0:
            errs.append(f"duration {self.duration!r}: must be >= 0 seconds (0: until stopped)")
        if self.max_requests is not None and (not isinstance(self.max_requests, int) or self.max_requests < 1):
            errs.append(f"max_requests {self.max_requests!r}: must be an integer >= 1")
        if not self.bucket > 0:
            errs.append(f"bucket {self.bucket!r}: must be > 0 seconds (timeline bucket width)")
        if not self.timeout > 0:
            errs.append(f"timeout {self.timeout!r}: must be > 0 seconds")
        if self.grace is not None and not self.grace >= 0:
            errs.append(f"grace {self.grace!r}: must be >= 0 seconds")
        if self.min_output_tokens is not None and not 0 <= self.min_output_tokens <= self.max_tokens:
            errs.append(f"min_output_tokens {self.min_output_tokens!r}: must be between 0 and max_tokens "
                        f"({self.max_tokens})")
        for name in ("error_samples", "max_failed", "min_completed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                errs.append(f"{name} {getattr(self, name)!r}: must be an integer >= 0")
        if self.stop_file and os.path.exists(self.stop_file):
            errs.append(f"stop_file {self.stop_file}: exists already (left by an earlier run?); remove it or "
                        "pick another path, else the run would stop at once")
        if errs:
            raise ConfigError("; ".join(errs))


def client_api_key(index: int = 1) -> str | None:
    """The front door's client key for the bench tools and tests, never from argv: $PD_LOAD_API_KEY, else the file
    $PD_API_KEY_FILE, else the local stack's key made by scripts/bootstrap (.cache/frontdoor/api-key).

    index 2 (the local stack's second client key): $PD_LOAD_API_KEY_2, else $PD_API_KEY_FILE_2, else
    .cache/frontdoor/api-key-2 (scripts/bootstrap.d/60-frontdoor-key); likewise _N / api-key-N for index N."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 1:
        raise ValueError(f"client_api_key(index={index!r}): the key number must be an integer >= 1")
    suffix = "" if index == 1 else f"_{index}"
    if os.environ.get(f"PD_LOAD_API_KEY{suffix}"):
        return os.environ[f"PD_LOAD_API_KEY{suffix}"]
    name = "api-key" if index == 1 else f"api-key-{index}"
    default = Path(__file__).resolve().parents[1] / ".cache/frontdoor" / name
    path = os.environ.get(f"PD_API_KEY_FILE{suffix}") or str(default)
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None
