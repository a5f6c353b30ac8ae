"""When and how long the client waits before sending a request again.

Only what is safe is retried:

- A connection that could not be made (``httpx.ConnectError``/``ConnectTimeout``: not one byte
  of the request reached the service) is retried for every call.
- A transport failure after the request was sent (the answer was lost: read errors, timeouts,
  a dropped connection) and a 503 (``overloaded``, with ``Retry-After``) are retried only for
  idempotent calls: every ``GET``, ``POST /classify`` (a pure function of its body) and
  ``POST .../lease/heartbeat`` (renewing one lease twice is renewing it once).
- Never retried: any other status, in particular 409 (``resume_refused``, ``lease_not_held``,
  ...), 422 and 423 (``run_locked``: waiting for a lease is :meth:`RecoveryClient.lease`'s
  ``wait``, not a retry), and the calls that change a run: create, validate (each resume
  across drift appends a journal line and a drift event, so a replay would journal twice),
  lease acquire/release/takeover, reserve (a replay consumes execution numbers), extend,
  resubmit, approvals, re-judgments and reindex.

The delay before retry ``n`` (1-based) is ``initial_backoff * multiplier**(n-1)`` capped at
``max_backoff``, with up to ``jitter`` of it added at random; a ``Retry-After`` the service
sent replaces it (capped at ``max_retry_after``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["NO_RETRY", "RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry; see the module documentation for what is retried."""

    #: Tries in all, the first included (1 = never retry).
    max_attempts: int = 4
    initial_backoff: float = 0.2
    multiplier: float = 2.0
    max_backoff: float = 5.0
    #: Fraction of the backoff added at random (0 = none).
    jitter: float = 0.1
    #: The longest ``Retry-After`` honoured; a longer one is waited for this long.
    max_retry_after: float = 30.0
    #: HTTP statuses retried on idempotent calls.
    retry_statuses: frozenset[int] = frozenset({503})
    #: How to wait (tests and embedders may substitute their own).
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.max_retry_after < 0:
            raise ValueError("backoff times must not be negative")

    def backoff(self, retry: int) -> float:
        """The delay before retry ``retry`` (1-based) without advice from the service."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** max(0, retry - 1))
        if self.jitter > 0:
            base += random.uniform(0, base * self.jitter)
        return base

    def delay(self, retry: int, retry_after: float | None) -> float:
        """The delay before retry ``retry``: the service's ``Retry-After`` when it sent one."""
        if retry_after is not None:
            return min(max(0.0, retry_after), self.max_retry_after)
        return self.backoff(retry)


#: Send every request once.
NO_RETRY = RetryPolicy(max_attempts=1)
