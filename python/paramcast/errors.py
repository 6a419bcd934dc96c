"""ParamCast's exceptions.

Every runtime failure of the C++ core arrives as :class:`Error`, whose
``code`` is the Status code of docs/errors.md (``"REJECTED"``,
``"PEER_LOST"``, ``"TIMEOUT"``, ...). Bad tensors raise the built-in
``ValueError``.
"""


class Error(Exception):
    """A ParamCast operation failed; ``code`` says what kind of failure."""

    code = "INTERNAL"


class ConfigError(Error, ValueError):
    """A configuration is invalid; the message names the key, the bad value and what was expected."""

    code = "INVALID_ARGUMENT"


class RejectedError(Error):
    """A peer refused (duplicate worker id, unknown id, protocol version)."""

    code = "REJECTED"


class PeerLostError(Error, ConnectionError):
    """A peer died, left or went silent past control.heartbeat_timeout."""

    code = "PEER_LOST"


class DeadlineExceeded(Error, TimeoutError):
    """A deadline of the configuration passed (join_timeout, data_plane.stall_timeout, update_timeout, ...)."""

    code = "TIMEOUT"


class UnavailableError(Error):
    """Cannot be reached or run here (bind failure, backend not built, no CUDA device)."""

    code = "UNAVAILABLE"


_BY_CODE = {c.code: c for c in (ConfigError, RejectedError, PeerLostError, DeadlineExceeded, UnavailableError)}


def for_code(code):
    """The exception class of a docs/errors.md code ("PEER_LOST", ...); Error for the others."""
    return _BY_CODE.get(code, Error)


class UpdateError(Error):
    """A weight update failed.

    The message names every failing subscriber and why; ``result`` is the
    full :class:`paramcast.UpdateResult` (per-subscriber outcomes, and in
    ``result.mismatches`` every ``(worker_id, Mismatch)`` of a rejected plan).
    """

    def __init__(self, result):
        self.result = result
        self.code = result.code
        label = f"update v{result.version}" if result.version else "update (refused before a version was assigned)"
        lines = [f"{label} failed: {result.error}"]
        for outcome in result.subscribers:
            if outcome.mismatches:
                lines.append(f"  {outcome.worker_id}: {len(outcome.mismatches)} mismatches")
                lines.extend(f"    {m}" for m in outcome.mismatches)
            elif not outcome.ok:
                lines.append(f"  {outcome.worker_id}: {outcome.error}")
        for worker in result.missing:
            lines.append(f"  {worker}: missing")
        super().__init__("\n".join(lines))
