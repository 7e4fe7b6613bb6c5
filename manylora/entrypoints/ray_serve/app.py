"""``manylora serve-ray`` and ``build_app``: ``manylora serve``'s API over several engine
replicas on Ray Serve, routed by adapter with Ray Serve's model multiplexing.

The application has three deployments (Ray Serve composes them into one app):

* ``OpenAIIngress`` (``ingress.py``): the HTTP front behind Ray Serve's proxy;
* ``EngineReplica`` (``replica.py``): ``--num-replicas`` (or autoscaled) whole servers, each
  with its own engine on ``--gpus-per-replica`` GPUs of one node (a placement group
  bundle, so a tensor-parallel group stays together);
* ``AdapterControl`` (``control.py``): run-time adapter changes and replica metrics.

``build_app`` takes the same flags as ``manylora serve`` plus the Ray ones below, either as an
argv list or as a mapping (Ray Serve's config ``args:``: keys are flag names with ``_`` or
``-``; ``true`` turns a switch on, ``false`` off, a list repeats or extends the flag), so the
app can be named in a Serve config file as ``import_path: manylora.entrypoints.ray_serve:
build_app``.
"""

from __future__ import annotations

import argparse
import json
import logging
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from manylora.engine.arg_utils import EngineArgs
from manylora.entrypoints.openai.http_limits import ConnectionLimits
from manylora.entrypoints.openai.launcher import add_serve_args
from manylora.entrypoints.openai.vllm_flags import expand_config_file

logger = logging.getLogger(__name__)

#: Seconds added to ``lora_load_timeout`` for a run-time load or unload to reach every
#: replica (their polls, the reads themselves).
CHANGE_MARGIN_S = 30.0
#: Ongoing requests the ingress and the control replica each accept at once.
FRONT_MAX_ONGOING = 100_000


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


def _gpus(ns: argparse.Namespace, engine: EngineArgs) -> float:
    if ns.gpus_per_replica is not None:
        if ns.gpus_per_replica < 0:
            raise ValueError(f"--gpus-per-replica must be ≥ 0, got {ns.gpus_per_replica}")
        return ns.gpus_per_replica
    import ray

    has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    return float(engine.tensor_parallel_size) if has_gpus and engine.device != "cpu" else 0.0


def engine_deployment_options(ns: argparse.Namespace, engine: EngineArgs) -> dict[str, Any]:
    """The ``serve.deployment`` options of the engine replicas: their count (fixed, or
    ``autoscaling_config``), ``max_ongoing_requests``, CPUs and GPUs, and for GPU replicas a
    one-bundle ``STRICT_PACK`` placement group (the replica and its tensor-parallel workers
    on one node's GPUs).

    Raises:
        ValueError: a negative ``--gpus-per-replica``.
    """
    gpus = _gpus(ns, engine)
    options: dict[str, Any] = {
        "max_ongoing_requests": ns.max_ongoing_requests or engine.max_num_seqs,
        "ray_actor_options": {"num_cpus": ns.cpus_per_replica, "num_gpus": gpus}}
    if ns.max_replicas is not None:
        options["autoscaling_config"] = {
            "min_replicas": ns.min_replicas, "max_replicas": ns.max_replicas,
            "target_ongoing_requests": ns.target_ongoing_requests or engine.max_num_seqs}
    else:
        options["num_replicas"] = ns.num_replicas
    if gpus:
        options["placement_group_bundles"] = [{"CPU": ns.cpus_per_replica, "GPU": gpus}]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def build_app(args: Sequence[str] | Mapping[str, Any]):
    """The Ray Serve application of ``manylora serve-ray``'s flags.

    Args:
        args: the flags, as an argv list or a mapping (a Serve config's ``args:``).

    Returns:
        A ``ray.serve.Application`` (the ingress bound to the engine replicas and the
        control replica) for ``serve.run`` or a Serve config's ``import_path``.

    Raises:
        ValueError: bad flags (:func:`parse`); the engine's own flag errors surface when a
            replica starts (``manylora serve``'s).
    """
    from ray import serve

    from manylora.entrypoints.ray_serve.control import AdapterControl
    from manylora.entrypoints.ray_serve.ingress import IngressConfig, OpenAIIngress
    from manylora.entrypoints.ray_serve.replica import EngineReplica

    ns, argv = parse(args)
    engine = EngineArgs.from_cli_args(ns)
    # no access log line per call: each engine replica polls it at least once per POLL_S
    control = serve.deployment(AdapterControl, name="AdapterControl", num_replicas=1,
                               max_ongoing_requests=FRONT_MAX_ONGOING,
                               ray_actor_options={"num_cpus": 0},
                               logging_config={"enable_access_log": False}).bind()
    engines = serve.deployment(EngineReplica, name="EngineReplica",
                               **engine_deployment_options(ns, engine)).bind(argv, control)
    config = IngressConfig(
        base_model_names=tuple(dict.fromkeys(ns.served_model_name or [ns.model])),
        max_request_body_bytes=ns.max_request_body_bytes,
        adapter_change_timeout=(engine.lora_load_timeout or 600.0) + CHANGE_MARGIN_S)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="OpenAIIngress",
                               max_ongoing_requests=FRONT_MAX_ONGOING,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines, control, config)


def run_serve_ray(args: argparse.Namespace, argv: list[str]) -> int:
    """``manylora serve-ray``: start or join the Ray cluster, run the application on
    ``--host``/``--port`` (Ray Serve's proxy, with ``--ssl-*`` and ``--root-path``), and
    serve until interrupted; then the application is deleted.

    Raises:
        ValueError: bad flags.
    """
    import ray
    from ray import serve

    ray.init(address=args.address)          # None: $RAY_ADDRESS, else a new local cluster
    http = {"host": args.host, "port": args.port, "ssl_keyfile": args.ssl_keyfile,
            "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
            "root_path": args.root_path}
    serve.start(http_options={k: v for k, v in http.items() if v is not None})
    serve.run(build_app(argv), name=args.app_name, route_prefix="/", blocking=False)
    logger.warning("manylora serve-ray: serving %s on %s:%d", args.app_name, args.host,
                   args.port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(args.app_name)
    return 0
