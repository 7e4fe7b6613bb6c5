"""Multi-turn sessions: a conversation's history and the KV it keeps between turns.

TurboMind's interactive mode: a turn sends only its new tokens; the session supplies the
history (every earlier prompt and output), and the KV of that history stays in the cache
between turns, so the next turn prefills only what is new. An idle session's KV is
released least recently used under memory pressure; the session keeps its token ids and
the next turn recomputes what the prefix cache no longer holds (eviction to token ids).
No tensors here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from manylora.request import Request, RequestStatus
from manylora.scheduler.kv_cache_manager import KVCacheManager


@dataclass(eq=False)
class Session:
    """One conversation.

    Attributes:
        session_id: the caller's name for it.
        last_turn: the last finished turn (its ``token_ids`` are the history; its
            ``num_computed_tokens`` the tokens whose KV the session holds while idle), or
            None before the first turn ends.
        active_request: id of the turn in flight, or None when idle.
        ended: ``end_session`` was called while a turn was in flight: drop it after.
        lost_tokens: computed tokens whose KV was released while idle (an eviction).
    """

    session_id: str
    last_turn: Request | None = None
    active_request: str | None = None
    ended: bool = False
    lost_tokens: int = 0

    @property
    def holder(self) -> str:
        """The name the session's blocks are held under in the KV cache manager."""
        return f"\x00session:{self.session_id}"

    @property
    def history(self) -> list[int]:
        return [] if self.last_turn is None else list(self.last_turn.token_ids)


class SessionTable:
    """Sessions by id, and the idle ones that hold KV in least-recently-used order.

    Args:
        kv: the block allocator that holds an idle session's blocks under
            ``Session.holder``.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.sessions: dict[str, Session] = {}
        self._idle_with_kv: OrderedDict[str, None] = OrderedDict()

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def history(self, session_id: str) -> list[int]:
        """The token ids a new turn of the session starts with ([] for a new session).

        Raises:
            ValueError: a turn of the session is still in flight.
        """
        sess = self.sessions.get(session_id)
        if sess is None:
            return []
        if sess.active_request is not None:
            raise ValueError(f"session {session_id!r} already has a turn in flight (request "
                             f"{sess.active_request!r}); send the next turn after it ends")
        return sess.history

    def begin(self, request: Request) -> Session:
        """Register ``request`` as the session's turn in flight (creating the session)."""
        sess = self.sessions.setdefault(request.session_id, Session(request.session_id))
        sess.active_request = request.request_id
        sess.ended = False
        return sess

    def keep(self, sess: Session, turn: Request) -> None:
        """The turn ended normally: it is the history, and its KV is held while idle."""
        sess.last_turn = turn
        sess.active_request = None
        sess.lost_tokens = 0
        self._idle_with_kv[sess.session_id] = None
        self._idle_with_kv.move_to_end(sess.session_id)

    def released(self, sess: Session) -> None:
        """The session holds no KV any more (adopted by a turn, evicted or ended)."""
        self._idle_with_kv.pop(sess.session_id, None)

    def lru_idle(self) -> Session | None:
        """The idle session holding KV that was used least recently, or None."""
        for sid in self._idle_with_kv:
            return self.sessions[sid]
        return None

    def drop(self, sess: Session) -> None:
        self.released(sess)
        self.sessions.pop(sess.session_id, None)

    def release_kv(self, sess: Session) -> None:
        """Free the blocks the session holds (full ones stay in the prefix cache)."""
        self.kv.free(sess.holder)
        self.released(sess)

    def evict_lru(self) -> bool:
        """Release the KV of the least recently used idle session (its full blocks stay in
        the prefix cache or go to swap space); False when no idle session holds any."""
        sess = self.lru_idle()
        if sess is None:
            return False
        self.kv.swap_out(sess.last_turn, sess.holder)
        sess.lost_tokens = sess.last_turn.num_computed_tokens
        self.release_kv(sess)
        self.kv.stats.evicted_sessions += 1
        return True

    def end(self, session_id: str) -> bool:
        """Forget a session: the blocks only it held are freed (full ones stay in the prefix
        cache). A turn in flight finishes first. False for an unknown id."""
        sess = self.sessions.get(session_id)
        if sess is None:
            return False
        if sess.active_request is not None:
            sess.ended = True
        else:
            self.release_kv(sess)
            self.drop(sess)
        return True

    def end_turn(self, req: Request, status: RequestStatus) -> None:
        """A session's turn ended with ``status``, before the scheduler frees the turn's
        blocks: a normal end makes the turn the history and moves its blocks under
        ``Session.holder``; after an abort the history stays the previous turn's (the KV
        the turn adopted is freed with it); a session ended meanwhile goes."""
        sess = self.sessions.get(req.session_id)
        if sess is None or sess.active_request != req.request_id:
            return
        sess.active_request = None
        # a step launched before the turn stopped may have computed its last token's KV
        # (async scheduling); the session keeps what a synchronous step leaves: all but it
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if sess.ended:
            self.release_kv(sess)
            self.drop(sess)
        elif status is not RequestStatus.FINISHED_ABORTED:
            self.release_kv(sess)        # its KV, if any, was not adopted
            self.kv.rename(req.request_id, sess.holder)
            self.keep(sess, req)
