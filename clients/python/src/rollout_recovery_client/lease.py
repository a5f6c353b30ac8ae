"""``LeaseKeeper``: own a run for a block, renewing the lease in a background thread."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from .errors import (
    LeaseLostError,
    LeaseNotHeldError,
    NotFoundError,
    RecoveryError,
    RunLockedError,
)
from .models import Lease

if TYPE_CHECKING:
    from .client import RecoveryClient

__all__ = ["LeaseKeeper", "LostCallback", "acknowledge", "parse_time"]

logger = logging.getLogger("rollout_recovery_client")

#: Called from the renewal thread, at once, when the lease is lost.
LostCallback = Callable[[LeaseLostError], None]

_ACKNOWLEDGED = "_rr_acknowledged"


def acknowledge(error: LeaseLostError) -> None:
    """Mark a loss as reported to the collector (it is then not raised again on exit)."""
    setattr(error, _ACKNOWLEDGED, True)


def _acknowledged(error: LeaseLostError) -> bool:
    return bool(getattr(error, _ACKNOWLEDGED, False))


def parse_time(value: str | None) -> float | None:
    """Unix seconds of an RFC 3339 UTC time the service wrote (``2026-12-02T01:26:25.857231Z``)."""
    if not value:
        return None
    text = value.strip().replace("Z", "+00:00").replace("z", "+00:00")
    # Python before 3.11 reads at most six fractional digits.
    if "." in text:
        head, _, rest = text.partition(".")
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        text = f"{head}.{digits[:6].ljust(6, '0')}{rest}"
    try:
        when = _dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.timestamp()


class LeaseKeeper:
    """Owns a run while its ``with`` block runs (see :meth:`RecoveryClient.lease`).

    - ``__enter__`` acquires the lease; while another holder's lease is live it waits up to
      ``wait`` seconds (polling until that lease's expiry), then raises ``RunLockedError``.
    - A daemon thread renews it every ``renew_fraction`` of the TTL (the requested
      ``ttl_seconds``, else the service's default as the grant shows it). A renewal the service
      refuses (``lease_not_held``: expired, taken over) loses the lease at once; a renewal that
      cannot reach the service is retried until the lease's expiry, then the lease is lost.
    - On loss: ``on_lost(error)`` is called from the renewal thread, ``check()`` raises
      ``LeaseLostError``, and so does the next call on the client that took the lease.
    - ``__exit__`` stops renewing and releases (also when the block raised). A loss never
      reported to the block (by ``check()`` or a client call) is raised on exit unless another
      exception is already propagating.
    """

    def __init__(
        self,
        client: RecoveryClient,
        run_id: str,
        *,
        holder: str | None = None,
        host: str | None = None,
        pid: int | None = None,
        ttl_seconds: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        renew_fraction: float = 1 / 3,
        on_lost: LostCallback | None = None,
        wait: float = 0.0,
    ) -> None:
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1 (exclusive)")
        if ttl_seconds is not None and ttl_seconds < 1:
            raise ValueError("ttl_seconds must be at least 1")
        self._client = client
        self.run_id = run_id
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self._host = host
        self._pid = pid
        self._ttl_request = ttl_seconds
        self._checkpoint_dir = checkpoint_dir
        self._fraction = renew_fraction
        self._on_lost = on_lost
        self._wait = wait
        self._lease: Lease | None = None
        self._ttl = float(ttl_seconds) if ttl_seconds is not None else 60.0
        self._expires_mono = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._lost: LeaseLostError | None = None
        self._released = False
        self.renewals = 0

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("held" if self._lease and not self._released else "idle")
        return f"LeaseKeeper(run_id={self.run_id!r}, holder={self.holder!r}, {state})"

    # -- what the block reads -----------------------------------------------------------

    @property
    def lease(self) -> Lease:
        if self._lease is None:
            raise RuntimeError("the lease has not been acquired (enter the context first)")
        return self._lease

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    @property
    def ttl(self) -> float:
        """Seconds the lease lasts from each renewal."""
        return self._ttl

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def lost_error(self) -> LeaseLostError | None:
        return self._lost

    def check(self) -> None:
        """Raise ``LeaseLostError`` if the lease was lost (the collector must stop writing)."""
        error = self._lost
        if error is not None:
            acknowledge(error)
            self._client._forget_lost(error)
            raise error

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> LeaseKeeper:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release(raising=exc is None)

    def acquire(self) -> Lease:
        """Acquire the lease (waiting up to ``wait`` seconds for another holder's to end) and
        start renewing it."""
        if self._lease is not None and not self._released:
            raise RuntimeError("this keeper holds its lease already")
        deadline = time.monotonic() + max(0.0, self._wait)
        sleep = self._client.retry_policy.sleep
        while True:
            started = time.monotonic()
            try:
                lease = self._client.acquire_lease(
                    self.run_id,
                    self.holder,
                    host=self._host,
                    pid=self._pid,
                    ttl_seconds=self._ttl_request,
                    checkpoint_dir=self._checkpoint_dir,
                )
                break
            except RunLockedError as error:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                delay = 0.25
                holder = error.holder
                expires = parse_time(holder.expires_at) if holder is not None else None
                if expires is not None:
                    delay = expires - time.time() + 0.05
                sleep(min(max(delay, 0.05), 1.0, remaining))
        if self._ttl_request is None:
            expires = parse_time(lease.expires_at)
            if expires is not None:
                self._ttl = max(1.0, round(expires - time.time()))
        self._lease = lease
        self._expires_mono = started + self._ttl
        self._released = False
        self._lost = None
        self._stop.clear()
        # The renewal thread retries by itself until the lease's expiry: its requests are sent
        # once each, and may take no longer than a renewal interval.
        policy = self._client.retry_policy
        renewer = self._client.clone(
            retry=dataclasses.replace(policy, max_attempts=1),
            timeout=max(1.0, self._ttl * self._fraction),
        )
        self._thread = threading.Thread(
            target=self._renew_loop,
            args=(renewer,),
            name=f"rr-lease-{self.run_id[:12]}",
            daemon=True,
        )
        self._thread.start()
        return lease

    def release(self, *, raising: bool = True) -> None:
        """Stop renewing and release the lease. With ``raising``, a loss the block was never
        told of raises ``LeaseLostError`` here."""
        if self._lease is None or self._released:
            return
        self._released = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._lost is None:
            try:
                self._client._release_quietly(self.run_id, self.lease_id)
            except LeaseNotHeldError as error:
                self._mark_lost(error, notify_client=False)
            except RecoveryError as error:
                # The lease ends by its TTL anyway; the block's work is done.
                logger.warning("releasing the lease of run %s failed: %s", self.run_id, error)
        lost = self._lost
        if lost is not None:
            self._client._forget_lost(lost)
            if raising and not _acknowledged(lost):
                acknowledge(lost)
                raise lost

    # -- the renewal thread -------------------------------------------------------------

    def _mark_lost(self, cause: BaseException, *, notify_client: bool = True) -> None:
        with self._state_lock:
            if self._lost is not None:
                return
            # The cause's code, never its message: the service's message carries the lease id.
            why = (
                f"{cause.code}, HTTP {cause.status}"
                if isinstance(cause, RecoveryError) and cause.status is not None
                else (cause.code if isinstance(cause, RecoveryError) else type(cause).__name__)
            )
            error = LeaseLostError(
                f"the lease of run {self.run_id} held as {self.holder!r} was lost ({why}): "
                "it expired or another holder took the run over; stop writing",
                run_id=self.run_id,
                cause=cause,
            )
            self._lost = error
        logger.warning("%s", error.message)
        if notify_client:
            self._client._note_lost(error)
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:
                logger.exception("the on_lost callback of run %s raised", self.run_id)

    def _renew_loop(self, renewer: RecoveryClient) -> None:
        try:
            interval = max(0.05, self._ttl * self._fraction)
            wait = interval
            while not self._stop.wait(wait):
                sent = time.monotonic()
                try:
                    lease = renewer.heartbeat(
                        self.run_id, self.lease_id, ttl_seconds=self._ttl_request
                    )
                except (LeaseNotHeldError, NotFoundError) as error:
                    if not self._stop.is_set():
                        self._mark_lost(error)
                    return
                except Exception as error:
                    if self._stop.is_set():
                        return
                    left = self._expires_mono - time.monotonic()
                    if left <= 0:
                        self._mark_lost(error)
                        return
                    logger.debug("renewing the lease of run %s failed: %s", self.run_id, error)
                    wait = min(interval, max(0.05, left / 4))
                    continue
                self._lease = lease
                self._expires_mono = sent + self._ttl
                self.renewals += 1
                wait = interval
        finally:
            renewer.close()
