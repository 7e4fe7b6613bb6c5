"""An ``EngineCoreRequest`` checked and turned into the scheduler's ``Request``
(``EngineCore.add_request``)."""

from __future__ import annotations

from manylora.engine.protocol import EngineCoreRequest
from manylora.lora.manager import LoRAManager
from manylora.lora_request import LoRARequest, alora_start
from manylora.request import Request
from manylora.scheduler.scheduler import Scheduler
from manylora.structured.manager import StructuredOutputManager


def require_lora(manager: LoRAManager | None, lora_request: LoRARequest) -> LoRAManager:
    """``manager``, or a ``ValueError`` naming the request when LoRA is off."""
    if manager is None:
        raise ValueError(f"LoRA request {lora_request.lora_name!r}: LoRA is disabled "
                         "(enable_lora=False)")
    return manager


def build_request(request: EngineCoreRequest, scheduler: Scheduler,
                  structured: StructuredOutputManager, vocab_size: int, max_model_len: int,
                  lora_manager: LoRAManager | None) -> tuple[Request, list[int], bool]:
    """Check ``request`` and make its ``Request``, its adapter added to ``lora_manager``
    (a reference the request holds until it ends); a prompt longer than a ``longrope``
    model's original length (``Scheduler.long_rope_after``) is ``Request.long_rope``.

    Returns:
        ``(request, history, ready)``: the ``Request`` (its prompt after its session's
        history), that history (empty without ``session_id``), and whether its adapter is
        in host memory already (True without one).

    Raises:
        ValueError: an empty prompt, ids outside the vocabulary (prompt, logit_bias,
            allowed_token_ids), a prompt (with its session's history) that leaves no room
            to generate within ``max_model_len``, a duplicate id, a session with a turn
            still in flight, structured outputs without a tokenizer, a LoRA request while
            LoRA is off, or an adapter that cannot be served as far as its config shows
            (``LoRAAdapterError``, ``FileNotFoundError``).
    """
    rid, params, session_id = request.request_id, request.sampling_params, request.session_id
    if rid in scheduler.requests or structured.is_held(rid):
        raise ValueError(f"request id {rid!r} is already in use")
    ids = request.prompt_token_ids
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary "
                         f"[0, {vocab_size})")
    if params is not None:
        params.verify_token_ids(vocab_size)
        if params.structured_outputs is not None:
            structured.check(rid)
    history: list[int] = []
    if session_id is not None:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        history = scheduler.sessions.history(session_id)
        ids = history + ids
    if len(ids) >= max_model_len:
        where = f" ({len(history)} of them the session's history)" if history else ""
        raise ValueError(f"the prompt has {len(ids)} tokens{where}, but the context holds "
                         f"{max_model_len} (max_model_len) with room for at least one "
                         "generated token")
    lora_request = request.lora_request
    digest = None
    ready = True
    lora_start = 0
    if lora_request is not None:
        manager = require_lora(lora_manager, lora_request)
        digest = manager.add(lora_request)
        ready = manager.is_ready(lora_request.lora_int_id)
        if digest is not None:
            lora_start = alora_start(ids, manager.invocation_tokens(lora_request.lora_int_id))
    limit = len(ids) + (params.max_tokens or max_model_len)
    req = Request(rid, None, list(ids), params, lora_request,
                  min(limit, max_model_len), arrival_time=request.arrival_time,
                  lora_digest=digest, session_id=session_id,
                  eos_token_ids=request.eos_token_ids,
                  adapter_pending=lora_request is not None and digest is None,
                  client_group=request.client_group, cache_salt=request.cache_salt,
                  long_rope=(scheduler.long_rope_after is not None
                             and len(ids) > scheduler.long_rope_after),
                  lora_start=lora_start)
    return req, history, ready
