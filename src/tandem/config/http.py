"""`HttpOptions`: `tandem serve`'s HTTP front end (address, auth, request limits, shutdown)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.options import option


@dataclass
class HttpOptions:
    """`tandem serve`'s HTTP front end."""

    host: str = option("127.0.0.1", "Address to bind; loopback by default.")
    port: int = option(8000, "Port to bind.")
    api_key: str | None = option(None, "Require 'Authorization: Bearer KEY' on /v1.", envvar="TANDEM_API_KEY")
    served_model_name: str | None = option(None, "Model name clients use (default: the directory name).")
    max_queue_len: int | None = option(None, "Requests in flight before new ones get 429.")
    log_requests: bool = option(False, "Log request contents (off by default).")
    max_request_bytes: int = option(1_000_000, "Largest request body accepted; larger ones get 413.")
    max_streams_per_key: int | None = option(
        None, "Streaming requests open at once per API key (per client address without a key); more get 429."
    )

    shutdown_timeout: float = option(
        20.0, "On SIGTERM or SIGINT, how long the requests in flight get to finish (new ones get 503) before "
        "they end with an error and the server stops; a second signal stops at once."
    )

    def __post_init__(self) -> None:
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_streams_per_key is not None and self.max_streams_per_key < 1:
            raise ValueError(f"--max-streams-per-key must be >= 1, got {self.max_streams_per_key}")
