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

from manylora.request import Request


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
    """Sessions by id, and the idle ones that hold KV in least-recently-used order."""

    def __init__(self) -> None:
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
