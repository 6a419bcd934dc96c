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


class UpdateError(Error):
    """A weight update failed.

    The message names every failing subscriber and why; ``result`` is the
    full :class:`paramcast.UpdateResult` (per-subscriber outcomes, and in
    ``result.mismatches`` every ``(worker_id, Mismatch)`` of a rejected plan).
    """

    def __init__(self, result):
        self.result = result
        self.code = result.code
        lines = [f"update v{result.version} failed: {result.error}"]
        for outcome in result.subscribers:
            if outcome.mismatches:
                lines.append(f"  {outcome.worker_id}: {len(outcome.mismatches)} mismatches")
                lines.extend(f"    {m}" for m in outcome.mismatches)
            elif not outcome.ok:
                lines.append(f"  {outcome.worker_id}: {outcome.error}")
        for worker in result.missing:
            lines.append(f"  {worker}: missing")
        super().__init__("\n".join(lines))
