"""The collective-call layer: every collective call of sokpy passes through here first.

Table creation, ``lookup_sparse`` and its backward, an optimizer step, ``assign``, ``save``
and ``load`` each open a :class:`Call` and call :meth:`Call.agree` before anything is
exchanged or changed. ``agree`` makes one fixed-size all-to-all of a small header per rank
(:data:`HEADER_WORDS` int64 words per peer), and every rank receives every other rank's
header, so all ranks take the same decision from the same data:

* a **call sequence number** (the n-th collective call of this process),
* a **fingerprint** of the call: the operation, the identities of its tables in order
  (agreed when the tables were created, never their user names) and anything else that
  must match (e.g. ``insert=False``),
* a **label**: the sequence number of the forward call a backward exchange belongs to,
* the **grad mode** (whether a lookup records a backward),
* this rank's **verdict** (any exception while it checked its input),
* a per-peer **count** (e.g. how many keys this rank sends to that peer next), a second
  per-peer count for the **reply** (e.g. how many row elements this rank expects back from
  that peer) and this rank's **volume** (elements it sends in the data exchanges of the
  call).

Because every call starts with the same header exchange of the same size, ranks that are
in different calls (another operation, other tables, the backward of another lookup, a
lookup under ``no_grad`` on one rank only) never pair their data by accident: they all
raise the same :class:`~sokpy.errors.CollectiveMismatchError`, naming every rank's call.
A bad input on any rank makes every rank raise the same :class:`~sokpy.errors.InputError`.
Only on such an error does a second, small exchange gather the messages. The header
replaces the count exchange a lookup makes anyway, so agreeing costs no extra round trip
there.

The header also decides, for all ranks alike, whether the call's data exchanges must be
split into pieces below MPI's 32-bit count limit (:attr:`Agreement.large`).

Example::

    import numpy as np, sokpy
    from sokpy.exchange import collective
    sokpy.init()
    with collective.Call("example") as call:
        agreement = call.agree(error=None, counts=np.zeros(sokpy.world_size(), np.int64))
"""

from __future__ import annotations

import hashlib
import itertools
import weakref
from typing import NamedTuple

import numpy as np

from ..backends import runtime, watchdog
from ..backends.comm import max_count
from ..errors import CollectiveMismatchError, InputError

__all__ = [
    "Call",
    "Channel",
    "Agreement",
    "HEADER_WORDS",
    "new_table_uid",
    "fingerprint",
    "agree_verdict",
    "calls_agreed",
]

HEADER_WORDS = 9
_MAGIC = 0x736F6B7079  # "sokpy"
_F_MAGIC, _F_SEQ, _F_FP, _F_LABEL, _F_MODE, _F_ERROR, _F_COUNT, _F_VOLUME, _F_REPLY = range(HEADER_WORDS)
_AGREED = slice(_F_MAGIC, _F_MODE + 1)  # the words every rank must have alike: the leading five

_seq = itertools.count(1)
_last_seq = 0  # the sequence number of the last agreement (0: none yet)
_table_uids = itertools.count(1)


def calls_agreed() -> int:
    """The sequence number of the last agreement this process made: the same on every rank
    between two collective calls, so it tells when something local (an optimizer's
    ``state_dict``) was taken."""
    return _last_seq


def new_table_uid() -> int:
    """The identity of the next table created in this process. Table creation is a
    collective call, so the n-th table has the same identity on every rank."""
    return next(_table_uids)


def restart_table_uids() -> None:
    """Table identities start over from 1, as in a new process (``sokpy.testing.start_over``;
    only while no table is alive). Forgets the fingerprints keyed by them."""
    global _table_uids
    _table_uids = itertools.count(1)
    _fingerprints.clear()


def fingerprint(text: str) -> int:
    """A 62-bit hash of ``text`` (non-negative, so -x never overflows)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _uid_or_none(t) -> int:
    """A table's uid; -1 for something that is not a table (a caller's mistake that the call
    must still report on every rank, not crash on)."""
    return getattr(t, "uid", -1)


def _name(t) -> str:
    name = getattr(t, "name", None)
    return name if isinstance(name, str) else f"<a {type(t).__name__}>"


# The fingerprints of recent calls by (op, detail, table uids): a training loop makes the same
# few calls again and again, and hashing the text of hundreds of tables each time would cost
# more than the rest of the header.
_fingerprints: dict = {}


class Agreement(NamedTuple):
    """What every rank learnt from the header exchange."""

    recv_counts: np.ndarray  # int64 [W]: the count each peer announced to this rank
    replies: np.ndarray  # int64 [W]: the reply count each peer expects from this rank
    large: bool  # the call's data exchanges must be split below MPI's 32-bit limit (same on every rank)
    seq: int  # this call's sequence number (the same on every rank)


class Channel:
    """Collective calls that one thread makes beside the main thread's, among themselves: on
    their own communicator (``comm``, a duplicate of sokpy's: ``Communicator.duplicate``)
    with their own sequence numbers, from :attr:`FIRST` on (far above any the main calls
    reach, so that a number names one call). They are not the main thread's calls: they
    leave :func:`calls_agreed` and the watchdog's count alone (the thread that waits for
    them does that). ``sokpy.nn.TrainPipeline`` agrees and exchanges the next batch's keys
    on one."""

    FIRST = 1 << 48

    def __init__(self, comm):
        self.comm = comm
        self.seq = itertools.count(self.FIRST)


class Call:
    """One collective call: the operation, its tables and what else must agree.

    ``op`` names the operation ("lookup_sparse", "lookup_sparse.backward", "Adagrad.step",
    "Variable", ...); ``tables`` are sokpy tables (anything with ``uid`` and ``name``);
    ``detail`` is text every rank must pass alike; ``label`` ties a backward exchange to
    its forward call, and ``label_text`` (text, or a function returning it, built only for a
    message) names that call; ``grad_mode`` must agree too; ``uids``, the tables' uids when
    the caller has them at hand, saves a pass over hundreds of tables; ``channel``: a
    :class:`Channel` the call is made on (default: sokpy's communicator, in the main
    sequence). Use as a context manager around the whole call, so that a watchdog (when one
    is active) knows which call a rank waits in (a channel's calls are not its: the thread
    that waits for them tells it).
    """

    def __init__(
        self,
        op: str,
        tables=(),
        detail: str = "",
        label: int = 0,
        grad_mode: bool = False,
        label_text="",
        uids: tuple | None = None,
        channel: Channel | None = None,
    ):
        self.op, self.tables, self.detail, self.label = op, tables, detail, int(label)
        self.uids, self.channel = uids, channel
        self.grad_mode = bool(grad_mode)
        self.label_text = label_text
        self.seq = 0
        self._watched: watchdog.call | None = None

    def describe(self) -> str:
        """e.g. ``lookup_sparse tables=[user, item]``, or ``backward of lookup_sparse ...
        (call #12)`` (user names, for messages)."""
        if self.label_text:
            label = self.label_text() if callable(self.label_text) else self.label_text
            return f"backward of {label}"
        text = self.op
        if self.tables:
            text += " tables=[" + ", ".join(map(_name, self.tables)) + "]"
        return text

    def _fingerprint(self) -> int:
        key = (self.op, self.detail, self.uids if self.uids is not None else tuple(map(_uid_or_none, self.tables)))
        fp = _fingerprints.get(key)
        if fp is None:
            if len(_fingerprints) >= 1024:
                _fingerprints.clear()
            uids = ",".join(map(str, key[2]))
            fp = _fingerprints[key] = fingerprint(f"{self.op}|{uids}|{self.detail}")
        return fp

    def __enter__(self) -> Call:
        if self.channel is None:
            self._watched = watchdog.call(_described(self))
            self._watched.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._watched is not None:
            watched, self._watched = self._watched, None
            watched.__exit__(*exc)  # the watchdog sees the call's exception (a transport that lost a peer)

    def agree(
        self, error: str | None, counts=None, volume: int = 0, error_type: type = InputError, replies=None
    ) -> Agreement:
        """Exchanges the header; returns the peers' counts, or raises the same error on every
        rank when any rank has an ``error`` or the ranks' calls differ.

        ``counts[d]`` (int64, one per rank) travels to rank d, and so does ``replies[d]`` (what
        this rank expects rank d to send back; the lookup's rows); ``volume`` is the number of
        elements this rank will send in the call's data exchanges (for the split decision);
        ``error_type`` (InputError or a subclass) is raised when some rank has an error."""
        global _last_seq
        if self.channel is None:
            comm = runtime.comm()
            self.seq = _last_seq = next(_seq)
        else:
            comm = self.channel.comm
            self.seq = next(self.channel.seq)
        world = comm.size
        if world == 1 and error is None:  # no peer to agree with: the header would come back as sent
            one = np.zeros(1, np.int64)
            recv_counts = one if counts is None else np.array(counts, np.int64).reshape(1)
            replies = one.copy() if replies is None else np.array(replies, np.int64).reshape(1)
            return Agreement(recv_counts, replies, int(volume) >= max_count(), self.seq)
        header = np.empty((world, HEADER_WORDS), np.int64)
        header[:, _F_MAGIC] = _MAGIC
        header[:, _F_SEQ] = self.seq
        header[:, _F_FP] = self._fingerprint()
        header[:, _F_LABEL] = self.label
        header[:, _F_MODE] = int(self.grad_mode)
        header[:, _F_ERROR] = int(error is not None)
        header[:, _F_COUNT] = 0 if counts is None else np.asarray(counts, np.int64)
        header[:, _F_VOLUME] = int(volume)
        header[:, _F_REPLY] = 0 if replies is None else np.asarray(replies, np.int64)
        recv = comm.alltoall_counts(header)
        agreed = bool((recv[:, _AGREED] == recv[0, _AGREED]).all())
        if agreed and not recv[:, _F_ERROR].any():
            large = int(recv[:, _F_VOLUME].sum()) >= max_count()
            return Agreement(recv[:, _F_COUNT].copy(), recv[:, _F_REPLY].copy(), large, self.seq)
        self._raise(comm, error, recv, agreed, error_type)
        raise AssertionError("unreachable")

    def _raise(self, comm, error: str | None, recv: np.ndarray, agreed: bool, error_type: type) -> None:
        """Every rank saw the same headers and takes this path together: gather the
        descriptions and messages (a second small exchange) and raise the same error."""
        reports = comm.allgather_object((self.describe(), self.seq, self.grad_mode, self.op, error, self.detail))
        # Leave the ranks in step for the calls that follow.
        global _seq, _last_seq
        if self.channel is None:
            _last_seq = int(recv[:, _F_SEQ].max())
            _seq = itertools.count(_last_seq + 1)
        else:
            self.channel.seq = itertools.count(int(recv[:, _F_SEQ].max()) + 1)
        errors = [f"rank {r}: {rep[4]}" for r, rep in enumerate(reports) if rep[4] is not None]
        if agreed:
            raise error_type(f"sokpy.{self.op}: " + "\n".join(errors))
        show_detail = len({rep[0] for rep in reports}) == 1  # the same call with other details: show them
        lines = []
        for r, (desc, seq, grad_mode, op, _, detail) in enumerate(reports):
            extra = f" {detail}" if show_detail and detail else ""
            no_grad = ", no_grad" if op == "lookup_sparse" and not grad_mode else ""
            lines.append(f"  rank {r}: {desc}{extra} (call #{seq}{no_grad})")
        ops = {rep[3] for rep in reports}
        if ops <= {"lookup_sparse"} and len({rep[2] for rep in reports}) > 1:
            hint = (
                "a lookup_sparse ran under torch.no_grad() (or with autograd off) on some ranks only: "
                "every rank must look up with autograd on, or every rank with it off"
            )
        elif len(ops) > 1 and any("state_dict" in op for op in ops):
            desc = next(rep[0] for rep in reports if "state_dict" in rep[3])
            hint = "some ranks are in a call the others did not make. " + watchdog.every_rank_hint(desc).rstrip(".")
        elif any(op.endswith(".backward") for op in ops):
            hint = (
                "the ranks ran the backward of different lookup_sparse calls (or some skipped one). Every rank "
                "must backpropagate through the same lookup calls, in the same order: each rank's loss must use "
                "at least one output of every lookup call it made with autograd on (add 0 * out.sum() for an "
                "output a rank does not need), and call backward() once per loss on every rank"
            )
        else:
            hint = (
                "every rank must make the same collective calls (table creation, lookup_sparse, backward, "
                "optimizer steps, assign, save, load) with the same tables in the same order"
            )
        text = f"sokpy: the ranks made different collective calls; {hint}.\n" + "\n".join(lines + errors)
        raise CollectiveMismatchError(text)


def agree_verdict(op: str, error: str | None, error_type: type = InputError) -> None:
    """A verdict found in the middle of a collective call, after its header (e.g. an owner's
    on the keys that reached it): when any rank has an ``error``, every rank raises the same
    ``error_type`` naming each rank's. Every rank of the call must call it at the same point,
    before anything changes. One allreduce of a flag (none on one rank); the messages are
    gathered only on an error."""
    comm = runtime.comm()
    if comm.size > 1:
        if not int(comm.allreduce(np.array([int(error is not None)], np.int64))[0]):
            return
        errors = comm.allgather_object(error)
    elif error is None:
        return
    else:
        errors = [error]
    raise error_type(f"sokpy.{op}: " + "\n".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None))


def _described(call: Call):
    """A function describing ``call`` that does not keep it (nor its tables) alive: the
    watchdog's thread holds it while it looks, and a program may drop those tables right
    after the call (a resumed run makes new ones of the same names at once)."""
    ref = weakref.ref(call)

    def describe() -> str:
        c = ref()
        return "(a call that has just ended)" if c is None else c.describe()

    return describe
