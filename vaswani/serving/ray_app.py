"""Scale-out on Ray Serve: N replicas of the same app (each with its own engine and continuous batching) behind Ray
Serve's HTTP proxy and router (`pip install 'vaswani[serve]'`, which brings `ray[serve]`).

Each replica loads the folder itself, so on a multi-machine Ray cluster the folder must be readable at the same path
on every node (shared storage) or be a Hugging Face Hub repository id (each replica downloads it). The routes are the
single-process server's (`app.create_app`); Ray's proxy routes each request to a replica with the fewest requests
in flight, and each replica batches the requests it gets.

    $ vaswani serve ./onnx-folder --ray --replicas 2 --cpus-per-replica 1       # a local Ray instance
    $ ray start --head                                                           # or a cluster: on the head node,
    $ ray start --address HEAD:6379                                              # on every other node,
    $ vaswani serve /shared/onnx-folder --ray --ray-address auto --replicas 8 --cpus-per-replica 2 --host 0.0.0.0

In Python (e.g. for `serve run` or a test):

    >>> from ray import serve
    >>> serve.run(build_ray_app("onnx-folder", replicas=2), route_prefix="/")
"""

import signal
import time
from typing import Any

from .app import create_app
from .models import load_service


class VaswaniReplica:
    """One replica: a service loaded from the folder and the FastAPI app over it (Ray builds the app after the
    constructor, on the replica, through `__serve_build_asgi_app__`)."""

    def __init__(self, folder: str, options: dict[str, Any]):
        self.service = load_service(folder, **options)
        engine = getattr(self.service, "engine", None)
        if engine is not None:
            engine.start()  # idempotent; Ray may or may not run the app's lifespan

    def __serve_build_asgi_app__(self):
        return create_app(self.service)


def build_ray_app(folder: str, replicas: int = 1, cpus_per_replica: float = 1.0, **options: Any):
    """The Ray Serve application (a bound deployment) of `replicas` replicas serving `folder`, each reserving
    `cpus_per_replica` CPUs; `options` go to `load_service` (`threads` defaults to the CPUs reserved)."""
    from ray import serve

    if replicas < 1 or cpus_per_replica <= 0:
        raise ValueError("replicas must be at least 1 and cpus_per_replica positive.")
    options = {**options, "threads": options.get("threads") or max(1, int(cpus_per_replica))}
    deployment = serve.deployment(
        serve.ingress()(VaswaniReplica),
        name="vaswani",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        # Each replica batches what it gets; let the router send it enough to fill a batch.
        max_ongoing_requests=max(16, options.get("max_batch", 16) + options.get("max_waiting", 64)),
    )
    return deployment.bind(folder, options)


def serve_with_ray(
    folder: str,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    **options: Any,
) -> None:
    """Start (or join, with `address`, e.g. "auto") a Ray cluster, run the app on it and serve HTTP on `host:port`
    until interrupted."""
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_ray_app(folder, replicas, cpus_per_replica, **options), name="vaswani", route_prefix="/")
    print(f"vaswani serve: {replicas} replica(s) of {folder} on http://{host}:{port} (Ctrl-C to stop)", flush=True)
    # SIGTERM (a process manager, `timeout`) stops the cluster started here as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
