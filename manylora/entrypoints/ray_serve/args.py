"""``manylora serve-ray``'s flags: ``manylora serve``'s, and the replicas' and the Ray
cluster's, read from an argv list or from a Serve config's ``args:`` mapping (keys are flag
names with ``_`` or ``-``; ``true`` turns a switch on, ``false`` off, a list repeats or extends
the flag), and checked for what Ray Serve's proxy cannot honour."""

from __future__ import annotations

import argparse
import json
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from manylora.entrypoints.openai.http_limits import ConnectionLimits
from manylora.entrypoints.openai.serve_args import add_serve_args
from manylora.entrypoints.openai.vllm_flags import expand_config_file


def add_ray_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``manylora serve``'s flags, and the replicas' and the Ray cluster's."""
    add_serve_args(parser)
    ray = parser.add_argument_group("Ray Serve")
    ray.add_argument("--num-replicas", type=int, default=1,
                     help="engine replicas (fixed; see --max-replicas for autoscaling)")
    ray.add_argument("--min-replicas", type=int, default=None,
                     help="autoscaling: the fewest engine replicas (with --max-replicas)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscaling: the most engine replicas; Ray Serve scales on "
                          "ongoing requests per replica")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscaling: ongoing requests per replica Ray Serve aims at "
                          "(default: --max-num-seqs)")
    ray.add_argument("--gpus-per-replica", type=float, default=None,
                     help="GPUs of one node each engine replica gets (default: "
                          "--tensor-parallel-size when the cluster has GPUs, else 0)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0,
                     help="CPUs each engine replica reserves")
    ray.add_argument("--max-ongoing-requests", type=int, default=None,
                     help="requests one engine replica takes at once (default: "
                          "--max-num-seqs); past it Ray Serve sends a request to a replica "
                          "without its adapter, or queues it: set it near the expected "
                          "requests per replica to spread a hot adapter over replicas "
                          "sooner")
    ray.add_argument("--address", default=None,
                     help="the Ray cluster to join ('auto', 'ray://host:port', host:port); "
                          "default: $RAY_ADDRESS, else a new local cluster")
    ray.add_argument("--app-name", default="manylora", help="the Ray Serve application name")
    return parser


def serve_ray_parser() -> argparse.ArgumentParser:
    """A parser of ``manylora serve-ray``'s flags."""
    return add_ray_args(argparse.ArgumentParser(prog="manylora serve-ray"))


def argv_of(args: Mapping[str, Any], parser: argparse.ArgumentParser) -> list[str]:
    """The command line a Serve config's ``args:`` mapping stands for.

    Raises:
        ValueError: a key that names no flag of ``parser``.
    """
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in args.items():
        action = by_dest.get(str(key).lstrip("-").replace("-", "_"))
        if action is None:
            raise ValueError(f"build_app: {key!r} is not a manylora serve-ray flag")
        flag = next(f for f in action.option_strings if f.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            if value:
                argv.append(flag)
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            if isinstance(action, argparse._AppendAction):
                for item in value:
                    argv += [flag, _text(item)]
            else:
                argv += [flag, *map(_text, value)]
        else:
            argv += [flag, _text(value)]
    return argv


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def parse(args: Sequence[str] | Mapping[str, Any]) -> tuple[argparse.Namespace, list[str]]:
    """The flags of ``args`` (an argv list or a Serve config mapping), and the argv.

    Raises:
        ValueError: an unknown or malformed flag, a bad ``--config`` file (read here, as
            ``manylora serve`` reads it), or a flag Ray Serve's proxy cannot honour
            (``--ssl-cert-reqs``, the connection limits of ``http_limits.py``).
    """
    parser = serve_ray_parser()
    argv = expand_config_file(parser, argv_of(args, parser) if isinstance(args, Mapping)
                              else args)
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        raise ValueError(f"manylora serve-ray: bad flags {argv!r} (see the message above)"
                         ) from e
    if ns.ssl_cert_reqs != int(ssl.CERT_NONE):
        raise ValueError("--ssl-cert-reqs: Ray Serve's proxy does not ask for client "
                         "certificates; leave it at 0")
    changed = [f"--{f.name.replace('_', '-')}" for f in fields(ConnectionLimits)
               if getattr(ns, f.name) != getattr(ConnectionLimits(), f.name)]
    if changed:
        raise ValueError(f"{', '.join(changed)}: Ray Serve's proxy serves the connections "
                         "with its own limits (serve.start's http_options); leave them unset")
    if ns.num_replicas < 1:
        raise ValueError(f"--num-replicas must be at least 1, got {ns.num_replicas}")
    if (ns.min_replicas is None) != (ns.max_replicas is None):
        raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
    if ns.max_replicas is not None and not 0 <= ns.min_replicas <= ns.max_replicas:
        raise ValueError(f"need 0 <= --min-replicas <= --max-replicas, got "
                         f"{ns.min_replicas} and {ns.max_replicas}")
    return ns, argv
