"""vLLM's front-end flags of ``vllm serve`` that ``manylora serve`` accepts with their meaning:
CORS (Starlette's ``CORSMiddleware``), TLS (uvicorn's own), ``--root-path`` (FastAPI's), the
request log, the periodic stats log, and vLLM's environment variables for run-time LoRA
updates and the filesystem LoRA resolver.

Nothing here serves HTTP itself: CORS and TLS are the libraries' features, configured from
the flags (vLLM's ``cli_args.py`` names and defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FrontendConfig", "add_frontend_args", "env_true", "frontend_config",
           "resolver_roots", "runtime_lora_updates", "uvicorn_tls_options"]

#: vLLM's resolver plugin name in ``VLLM_PLUGINS`` (a comma-separated list).
FILESYSTEM_RESOLVER = "lora_filesystem_resolver"


def env_true(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether environment variable ``name`` is on by vLLM's reading of its boolean
    variables: ``"1"`` or ``"true"`` (any case, surrounding blanks ignored); unset is off."""
    value = (os.environ if environ is None else environ).get(name, "0")
    return value.strip().lower() in ("1", "true")


def _string_list(values: list[str]) -> list[str]:
    """A list flag's values: each either one string or a JSON list of strings (vLLM's older
    form, ``--allowed-origins '["https://a.example"]'``)."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as e:
                raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list: {e}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings")
            out += items
        else:
            out.append(value)
    return out


def add_frontend_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add vLLM's CORS, TLS, root-path and logging flags (vLLM's names and defaults)."""
    parser.add_argument("--allowed-origins", nargs="+", default=["*"],
                        help="origins allowed to call the server from a browser (CORS); "
                             "each a string or a JSON list (default: any)")
    parser.add_argument("--allowed-methods", nargs="+", default=["*"],
                        help="HTTP methods allowed for cross-origin requests (default: any)")
    parser.add_argument("--allowed-headers", nargs="+", default=["*"],
                        help="request headers allowed for cross-origin requests (default: "
                             "any)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="allow cookies and Authorization in cross-origin requests")
    parser.add_argument("--ssl-keyfile", default=None, help="the TLS private key file")
    parser.add_argument("--ssl-certfile", default=None, help="the TLS certificate file")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help="CA certificates to verify clients' certificates with")
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                        help="whether clients must present a certificate: 0 none, 1 "
                             "optional, 2 required (Python's ssl.CERT_*)")
    parser.add_argument("--root-path", default=None,
                        help="the path prefix a proxy serves the app under (FastAPI's "
                             "root_path: the OpenAPI document's server URL and /docs use it)")
    parser.add_argument("--enable-log-requests", action="store_true", default=False,
                        dest="enable_log_requests",
                        help="log each request's prompt, sampling parameters and adapter "
                             "(off by default, as in vLLM)")
    parser.add_argument("--disable-log-requests", action="store_false",
                        dest="enable_log_requests",
                        help="do not log requests (the default; vLLM's older flag)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="the most prompt characters and prompt token ids a request "
                             "log line shows (default: all)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="do not log the engine's throughput, queue and cache use "
                             "every 10 seconds")
    return parser


@dataclass(frozen=True)
class FrontendConfig:
    """The app's share of the front-end flags (TLS is uvicorn's: :func:`uvicorn_tls_options`).

    Attributes:
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: Starlette's
            ``CORSMiddleware`` settings (vLLM's defaults: any origin, method and header,
            no credentials). Credentials need a list of origins: with ``*`` Starlette
            would echo whatever ``Origin`` a request sends, which the CORS standard
            forbids, and ``null`` is the origin of any sandboxed page or local file.
        root_path: FastAPI's ``root_path`` (``""``: none): the prefix a proxy serves the
            app under; routes are served with and without it.
        log_requests: log one line per engine request (``RequestLogger``).
        max_log_len: the most prompt characters / token ids a log line shows (None: all).
    """

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    log_requests: bool = False
    max_log_len: int | None = None

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/")
                               or self.root_path.endswith("/")):
            raise ValueError(f"--root-path {self.root_path!r} must start with '/' and not "
                             "end with one")
        if self.allow_credentials and ({"*", "null"} & set(self.allowed_origins)):
            bad = "'*'" if "*" in self.allowed_origins else "'null'"
            raise ValueError(
                f"--allow-credentials with --allowed-origins {bad}: the CORS standard "
                "forbids credentials for any origin (and 'null' is the origin of every "
                "sandboxed page and local file); list the origins that may send "
                "credentials, e.g. --allowed-origins https://app.example")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be ≥ 0, got {self.max_log_len}")

    def cors_options(self) -> dict:
        """``CORSMiddleware``'s keyword arguments."""
        return dict(allow_origins=list(self.allowed_origins),
                    allow_methods=list(self.allowed_methods),
                    allow_headers=list(self.allowed_headers),
                    allow_credentials=self.allow_credentials)


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    """The :class:`FrontendConfig` of parsed flags.

    Raises:
        ValueError: a list flag that is not strings or JSON lists of strings, a root path
            that does not start with ``/`` or ends with one, a negative ``--max-log-len``,
            ``--allow-credentials`` with the origin ``*`` (the default) or ``null``.
    """
    try:
        lists = {name: tuple(_string_list(getattr(args, name))) for name in
                 ("allowed_origins", "allowed_methods", "allowed_headers")}
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--allowed-*: {e}") from None
    return FrontendConfig(**lists, allow_credentials=args.allow_credentials,
                          root_path=args.root_path or "",
                          log_requests=args.enable_log_requests, max_log_len=args.max_log_len)


def uvicorn_tls_options(args: argparse.Namespace) -> dict:
    """uvicorn's TLS settings (``uvicorn.Config`` keywords) from the ``--ssl-*`` flags.

    Raises:
        ValueError: a key without a certificate or the other way round, or a
            ``--ssl-cert-reqs`` outside 0..2.
    """
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if not args.ssl_certfile:
        return {}
    return dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def runtime_lora_updates(flag: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether run-time adapter loads are on: ``--enable-lora-runtime-updates``, or vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to ``1`` / ``true``."""
    return flag or env_true("VLLM_ALLOW_RUNTIME_LORA_UPDATING", environ)


def resolver_roots(flag: bool, lora_roots: list[str],
                   environ: Mapping[str, str] | None = None) -> tuple[bool, list[str]]:
    """Whether the filesystem LoRA resolver is on, and the ``--lora-root`` directories with
    vLLM's resolver directory added: ``--enable-lora-resolver``, or vLLM's
    ``VLLM_PLUGINS`` naming ``lora_filesystem_resolver`` with the directory in
    ``VLLM_LORA_RESOLVER_CACHE_DIR``.

    Raises:
        ValueError: the plugin named without ``VLLM_LORA_RESOLVER_CACHE_DIR``.
    """
    env = os.environ if environ is None else environ
    plugins = [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",")]
    roots = list(lora_roots)
    if FILESYSTEM_RESOLVER not in plugins:
        return flag, roots
    cache_dir = env.get("VLLM_LORA_RESOLVER_CACHE_DIR", "").strip()
    if not cache_dir:
        raise ValueError(f"VLLM_PLUGINS names {FILESYSTEM_RESOLVER} but "
                         "VLLM_LORA_RESOLVER_CACHE_DIR is not set")
    if cache_dir not in roots:
        roots.append(cache_dir)
    return True, roots
