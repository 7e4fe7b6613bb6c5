"""The served models: the base model's name and the adapters, with loads at run time.

A request's ``model`` field names the base model (any of ``--served-model-name``'s names,
by default the ``--model`` argument; responses and metrics use the first) or an adapter.
Adapters come from ``--lora-modules`` at start-up and, with
``--enable-lora-runtime-updates``, from ``POST /v1/load_lora_adapter`` (``load_inplace``
replaces a served adapter's weights) and, with the LoRA resolver, from a request's first
use of a name that is an adapter directory under a root (``lora_resolver.py``); vLLM's names
and semantics, with one restriction of ours: a run-time load reads only from under the
``--lora-root`` directories.

``root`` in ``/v1/models`` is the path as the operator (``--model``, ``--lora-modules``) or
the caller (``lora_path``) gave it, never the resolved absolute path of a run-time load:
vLLM shows the path given, and the server's directory layout is not the client's business.
Load errors likewise name the given path.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from manylora.engine.async_llm import AsyncLLM, EngineDeadError
from manylora.entrypoints.openai.errors import OpenAIError, bad_request, not_found
from manylora.lora.adapter import LoRAAdapterError, LoRALoadTimeoutError
from manylora.lora.formats.loader import ADAPTER_FILES
from manylora.lora.formats.peft_config import read_peft_config
from manylora.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter named on the command line: ``NAME=PATH`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, spec: str) -> LoRAModulePath:
        """Parse one ``--lora-modules`` entry.

        Raises:
            ValueError: neither ``NAME=PATH`` nor a JSON object with ``name`` and ``path``.
        """
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                obj = json.loads(spec)
                return cls(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {spec!r}: expected a JSON object with "
                                 f"'name' and 'path' ({e})") from None
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        return cls(name, path)


def check_under_roots(path: str, roots: list[Path]) -> Path:
    """The adapter directory ``path`` resolved, if it lies under one of ``roots``.

    A relative path is taken relative to each root in turn. Refused: a ``..`` component,
    a path (after following symlinks) outside every root, and an adapter file
    (``ADAPTER_FILES``, the only files a read opens) that is a symlink leading out of the
    root. Bounded work: a handful of ``stat`` / ``resolve`` calls, no walk of the directory.
    It touches the filesystem: call it off the event loop.

    Raises:
        OpenAIError: 403 for any of the above; 404 when no such directory exists; 400 for
            a path that is not a directory, too long, a symlink loop, holds a NUL
            character or cannot be encoded for the filesystem. Messages name the path as
            the caller gave it, never the server's absolute path.
    """
    if not roots:
        raise OpenAIError(403, "loading adapters at run time needs --lora-root: no "
                          "directory is allowed", param="lora_path")
    try:
        return _check_under_roots(path, roots)
    except FileNotFoundError:
        raise not_found(f"lora_path {path!r}: no such adapter directory",
                        param="lora_path") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise bad_request(f"lora_path {path!r}: {_fs_problem(e)}", param="lora_path") from None


def _fs_problem(e: Exception) -> str:
    if isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP:
        return "a symlink loop"                 # Path.resolve raises RuntimeError for one
    if getattr(e, "errno", None) == errno.ENAMETOOLONG:
        return "the path is too long"
    if isinstance(e, UnicodeError):
        return "not encodable as a file name"
    if isinstance(e, ValueError):
        return "not a valid file name (a NUL character?)"
    return f"cannot be read ({e.strerror or type(e).__name__})"


def _check_under_roots(path: str, roots: list[Path]) -> Path:
    if "\x00" in path:
        raise ValueError("embedded null byte")
    raw = Path(path)
    if ".." in raw.parts:
        raise OpenAIError(403, f"lora_path {path!r}: '..' is not allowed", param="lora_path")
    candidates = [raw] if raw.is_absolute() else [root / raw for root in roots]
    existing = [c for c in candidates if c.exists() or c.is_symlink()]
    if not existing:
        raise not_found(f"lora_path {path!r}: no such adapter directory", param="lora_path")
    target = existing[0].resolve(strict=True)
    root = next((r.resolve() for r in roots if target.is_relative_to(r.resolve())), None)
    if root is None:
        raise OpenAIError(403, f"lora_path {path!r} is outside the --lora-root directories",
                          param="lora_path")
    if not target.is_dir():
        raise bad_request(f"lora_path {path!r} is not a directory", param="lora_path")
    for name in ADAPTER_FILES:
        entry = target / name
        if (entry.is_symlink() or entry.exists()) and not entry.resolve(
                strict=entry.exists()).is_relative_to(root):
            raise OpenAIError(403, f"lora_path {path!r}: {name} links outside the "
                              "--lora-root directories", param="lora_path")
    return target


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI's model object, vLLM's extra fields):
    ``root`` the path it was given as, ``parent`` the base model an adapter applies to,
    ``max_model_len`` the context length in tokens (the base model's entry only);
    ``alora_invocation_tokens`` an activated adapter's (aLoRA) invocation token ids, from
    which on it applies (None: a plain adapter, or the base model)."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "manylora"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    alora_invocation_tokens: list[int] | None = None


class ModelList(BaseModel):
    """The body of ``GET /v1/models``: the base model first, then every adapter."""

    object: str = "list"
    data: list[ModelCard]


@dataclass
class _Served:
    request: LoRARequest
    created: int
    shown_path: str          # the path as the caller gave it (``root`` in /v1/models)
    invocation: list[int] | None = None     # an activated adapter's invocation tokens


def _invocation_tokens(path: str, name: str) -> list[int] | None:
    """The ``alora_invocation_tokens`` of the PEFT adapter at a local ``path`` (the engine
    has read and checked its config already; ``read_peft_config`` reads it again, bounded),
    None for a plain adapter, a TensorRT-LLM one, or a hub id."""
    try:
        tokens = read_peft_config(path, name).get("alora_invocation_tokens")
    except LoRAAdapterError:
        return None
    return None if tokens is None else list(tokens)


class OpenAIServingModels:
    """The base model and the adapters a server answers to.

    Args:
        engine: the engine adapters load into.
        base_model_name: the name that selects the base model, reported in responses.
        base_model_path: where the base model came from (``root`` in ``/v1/models``).
        lora_modules: adapters to serve from start-up (``load_static_loras`` reads them).
        lora_roots: directories run-time loads may read from.
        aliases: further names that select the base model (``--served-model-name``'s
            others); each is listed in ``/v1/models``.
        resolver: a name → adapter directory lookup run on a thread for a ``model`` no one
            serves (``lora_resolver.FilesystemResolver``), None: unknown names are 404s.
    """

    def __init__(self, engine: AsyncLLM, base_model_name: str, base_model_path: str,
                 lora_modules: list[LoRAModulePath] = (), lora_roots: list[Path] = (),
                 aliases: Sequence[str] = (),
                 resolver: Callable[[str], Path | None] | None = None) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.base_model_names = tuple(dict.fromkeys((base_model_name, *aliases)))
        self.resolver = resolver
        self._resolving: dict[str, asyncio.Task] = {}
        self.base_model_path = base_model_path
        self.static_loras = list(lora_modules)
        self.lora_roots = [Path(r) for r in lora_roots]
        self.loras: dict[str, _Served] = {}
        self.created = int(time.time())
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def load_static_loras(self) -> None:
        """Read every ``--lora-modules`` adapter now.

        Raises:
            OpenAIError: a bad adapter (the server should not start).
        """
        for module in self.static_loras:
            await self._load(module.name, module.path, module.base_model_name)

    def resolve(self, name: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model.

        Raises:
            OpenAIError: 404 for a name that is neither the base model nor an adapter.
        """
        if name in self.base_model_names:
            return None
        served = self.loras.get(name)
        if served is None:
            raise not_found(f"The model `{name}` does not exist.", param="model")
        return served.request

    def list_models(self) -> dict:
        """``GET /v1/models``: the base model under each of its names, then every adapter
        with its parent (a :class:`ModelList` as a dict)."""
        base = [ModelCard(id=name, created=self.created, root=self.base_model_path,
                          max_model_len=self.engine.max_model_len)
                for name in self.base_model_names]
        loras = [ModelCard(id=name, created=s.created, root=s.shown_path,
                           parent=s.request.base_model_name or self.base_model_name,
                           alora_invocation_tokens=s.invocation)
                 for name, s in self.loras.items()]
        return ModelList(data=[*base, *loras]).model_dump(mode="json")

    def retrieve(self, name: str) -> dict:
        """``GET /v1/models/{name}``: one entry of ``list_models``.

        Raises:
            OpenAIError: 404 for a name that is neither the base model nor an adapter.
        """
        entry = next((m for m in self.list_models()["data"] if m["id"] == name), None)
        if entry is None:
            raise not_found(f"The model `{name}` does not exist.", param="model")
        return entry

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                load_inplace: bool = False) -> str:
        """``POST /v1/load_lora_adapter``: read the adapter from under ``--lora-root`` and
        serve it as ``lora_name``; a message saying so.

        With ``load_inplace`` (vLLM's), a name already served gets the new weights instead
        of a 400: they are read under a new adapter id while the old ones keep serving; once
        read, new requests for the name get them, requests already accepted finish with the
        weights they started with (their KV was computed under those), and the old adapter
        leaves the engine when the last of them ends. The new weights have their own digest,
        so the prefix cache never serves one version's KV to the other. A failed read leaves
        the old adapter served.

        Raises:
            OpenAIError: 400 for an empty name or path, a base model name, a taken name
                without ``load_inplace`` or a bad adapter, 403 for a path outside
                ``--lora-root``, 404 for a missing directory, 503 when the engine has
                stopped, 504 for a read over ``lora_load_timeout``.
        """
        if not lora_name or not lora_path:
            raise bad_request("both 'lora_name' and 'lora_path' must be given",
                              param="lora_name" if not lora_name else "lora_path")
        path = await asyncio.to_thread(check_under_roots, lora_path, self.lora_roots)
        replaced = await self._load(lora_name, str(path), None, shown_path=lora_path,
                                    inplace=load_inplace)
        return (f"Success: LoRA adapter '{lora_name}' "
                f"{'reloaded in place' if replaced else 'added'} successfully.")

    async def resolve_lora(self, name: str | None) -> None:
        """Load ``name`` through the resolver if it is not served yet (vLLM's LoRA resolver):
        the directory lookup runs on a thread, the read on the engine's loader pool, and
        concurrent first requests for one name share one load. Without a resolver, for a
        served name or one that resolves to no adapter directory, nothing happens (the
        request's own lookup answers 404 for an unknown name).

        Raises:
            OpenAIError: the load's error (400 a bad adapter, 503, 504), for every request
                waiting on that load.
        """
        if (self.resolver is None or not name or name in self.base_model_names
                or name in self.loras):
            return
        task = self._resolving.get(name)
        if task is None:
            task = asyncio.ensure_future(self._resolve_and_load(name))
            self._resolving[name] = task
            task.add_done_callback(lambda _: self._resolving.pop(name, None))
        await asyncio.shield(task)

    async def _resolve_and_load(self, name: str) -> None:
        path = await asyncio.to_thread(self.resolver, name)
        if path is None or name in self.loras:
            return
        await self._load(name, str(path), None, shown_path=name)

    async def _load(self, name: str, path: str, base_model_name: str | None,
                    shown_path: str | None = None, inplace: bool = False) -> bool:
        """Register adapter ``name`` read from ``path``; errors name the path as
        ``shown_path`` (what the caller gave) rather than ``path``. With ``inplace``, a
        served ``name`` is replaced (see :meth:`load_lora_adapter`). Whether one was."""
        async with self._lock:
            old = self.loras.get(name)
            if name in self.base_model_names:
                raise bad_request(f"'{name}' is a name of the base model", param="lora_name")
            if old is not None and not inplace:
                raise bad_request(f"The lora adapter '{name}' has already been loaded. To "
                                  "replace its weights, set 'load_inplace': true.",
                                  param="lora_name")
            if old is not None:
                base_model_name = old.request.base_model_name
            request = LoRARequest(name, next(self._ids), path, base_model_name)
            try:
                await self.engine.add_lora(request)
            except EngineDeadError as e:
                raise OpenAIError(503, str(e)) from None
            except (LoRAAdapterError, ValueError, OSError) as e:
                raise _load_error(e, name, path, shown_path or path) from None
            self.loras[name] = _Served(request, int(time.time()), shown_path or path,
                                       await asyncio.to_thread(_invocation_tokens, path,
                                                               name))
            if old is not None:
                try:
                    await self.engine.remove_lora(old.request.lora_int_id)
                except EngineDeadError as e:
                    raise OpenAIError(503, str(e)) from None
            return old is not None

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """``POST /v1/unload_lora_adapter``: stop serving ``lora_name``. New requests for
        it get 404 at once; requests already accepted finish with it, then it leaves the
        host cache and its slot. A message saying so.

        Raises:
            OpenAIError: 404 for a name no adapter has.
        """
        async with self._lock:
            served = self.loras.pop(lora_name, None)
            if served is None:
                raise not_found(f"The lora adapter '{lora_name}' cannot be found.",
                                param="lora_name")
            try:
                await self.engine.remove_lora(served.request.lora_int_id)
            except EngineDeadError as e:
                raise OpenAIError(503, str(e)) from None
        return f"Success: LoRA adapter '{lora_name}' removed successfully."


def _load_error(e: Exception, name: str, path: str, shown_path: str) -> OpenAIError:
    """The HTTP error of a failed adapter load: 404 for files gone, 504 for a read over
    ``lora_load_timeout``, else 400; the message says what is wrong once, names the
    adapter, and shows the path as the caller gave it."""
    message = str(e).replace(path, shown_path)
    if f"adapter {name!r}" not in message:
        message = f"adapter {name!r}: {message}"
    if isinstance(e, LoRALoadTimeoutError):
        return OpenAIError(504, message, param="lora_path", code="adapter_load_timeout")
    if isinstance(e, FileNotFoundError):
        return not_found(message, param="lora_path")
    return bad_request(message, param="lora_path")
