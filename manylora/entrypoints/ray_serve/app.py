"""``manylora serve-ray`` and ``build_app``: ``manylora serve``'s API over several engine
replicas on Ray Serve, routed by adapter with Ray Serve's model multiplexing.

The application has three deployments (Ray Serve composes them into one app):

* ``OpenAIIngress`` (``ingress.py``): the HTTP front behind Ray Serve's proxy;
* ``EngineReplica`` (``replica.py``): ``--num-replicas`` (or autoscaled) whole servers, each
  with its own engine on ``--gpus-per-replica`` GPUs of one node (a placement group
  bundle, so a tensor-parallel group stays together);
* ``AdapterControl`` (``control.py``): run-time adapter changes and replica metrics.

``build_app`` takes the same flags as ``manylora serve`` plus the Ray ones (``args.py``),
either as an argv list or as a mapping (Ray Serve's config ``args:``), so the app can be named
in a Serve config file as ``import_path: manylora.entrypoints.ray_serve:build_app``. This
module builds the deployment graph from the three deployment classes; they import nothing
from it.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from manylora.engine.arg_utils import EngineArgs
from manylora.entrypoints.ray_serve.args import parse

logger = logging.getLogger(__name__)

#: Seconds added to ``lora_load_timeout`` for a run-time load or unload to reach every
#: replica (their polls, the reads themselves).
CHANGE_MARGIN_S = 30.0
#: Ongoing requests the ingress and the control replica each accept at once.
FRONT_MAX_ONGOING = 100_000


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
        ValueError: bad flags (:func:`~manylora.entrypoints.ray_serve.args.parse`); the
            engine's own flag errors surface when a replica starts (``manylora serve``'s).
    """
    # Ray Serve is an optional extra: the deployments (which import it) load when an app is
    # built, so the flags above stay readable without it
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
