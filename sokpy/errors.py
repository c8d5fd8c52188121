"""Collective verdicts on input: every rank raises the same error, or none does.

A collective call (``lookup_sparse``, ``assign``, an optimizer ``step``) first checks its
input locally, then calls :func:`agree` before anything is exchanged or changed. One small
allreduce carries each rank's verdict and a fingerprint of the call (which operation, which
tables in which order), so a bad key on one rank, or ranks that passed different tables,
raise the same :class:`InputError` on every rank instead of leaving some rank hanging.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["InputError", "agree"]


class InputError(ValueError):
    """Bad input to a collective call, raised on every rank alike; nothing was changed."""


def _fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def agree(comm, call: str, error: str | None) -> None:
    """Raises :class:`InputError` on every rank if any rank has an ``error`` or if the ranks'
    ``call`` descriptions differ (e.g. ``"lookup_sparse tables=[user, item]"``)."""
    fp = _fingerprint(call)
    verdict = comm.allreduce(np.array([error is not None, fp, -fp], dtype=np.int64), op="max")
    if verdict[0] == 0 and verdict[1] == -verdict[2]:
        return
    reports = comm.allgather_object((call, error))
    lines = [f"rank {r}: {err}" for r, (_, err) in enumerate(reports) if err is not None]
    calls = {c for c, _ in reports}
    if len(calls) > 1:
        lines.append(
            "the ranks made different collective calls (each rank must pass the same tables in "
            "the same order): " + "; ".join(f"rank {r}: {c}" for r, (c, _) in enumerate(reports))
        )
    raise InputError(f"sokpy.{call.split()[0]}: " + "\n".join(lines))
