"""Scale-out on Ray Serve: N replicas of the same app (each with its own scheduler and continuous batching) behind Ray
Serve's HTTP proxy and router (`pip install 'vaswani[ray]'`, which brings `ray[serve]`).

Each replica loads the folder itself, so on a multi-machine Ray cluster the folder must be readable at the same path
on every node (shared storage) or be a Hugging Face Hub repository id (each replica downloads it). The routes are the
single-process server's (`app.create_app`) under the application's route prefix; Ray's proxy routes each request to
a replica with the fewest requests in flight, and each replica batches the requests it gets.

Each model is an application of its own on the cluster, named after the model (`--ray-app-name`) and reached under
its route prefix (`--route-prefix`, "/" by default), so several models share one cluster, and stopping one deletes
only its own application.

    $ vaswani serve ./onnx-folder --ray --replicas 2 --cpus-per-replica 1       # a local Ray instance
    $ ray start --head                                                           # or a cluster: on the head node,
    $ ray start --address HEAD:6379                                              # on every other node,
    $ vaswani serve /shared/onnx-folder --ray --ray-address auto --replicas 8 --cpus-per-replica 2 --host 0.0.0.0
    $ vaswani serve /shared/other-folder --ray --ray-address auto --route-prefix /other    # a second model beside it

In Python (e.g. for `serve run` or a test):

    >>> from ray import serve
    >>> serve.run(build_ray_app("onnx-folder", replicas=2), name="onnx-folder", route_prefix="/")
"""

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

from .app import create_app
from .services import load_service


class VaswaniReplica:
    """One replica: a service loaded from the folder and the FastAPI app over it (Ray builds the app after the
    constructor, on the replica, through `__serve_build_asgi_app__`)."""

    def __init__(self, folder: str, options: dict[str, Any], app_options: dict[str, Any] | None = None):
        self.service = load_service(folder, **options)
        self.app_options = app_options or {}
        scheduler = self.service.scheduler
        if scheduler is not None:
            scheduler.start()  # idempotent; Ray may or may not run the app's lifespan

    def __serve_build_asgi_app__(self):
        return create_app(self.service, **self.app_options)


def replica_max_ongoing_requests(max_batch: int = 16, max_waiting: int = 64) -> int:
    """How many requests Ray's router lets one replica hold at once: twice what the replica's scheduler can hold
    (`max_batch` running plus `max_waiting` queued). Ray queues whatever is over this limit in front of the replica,
    where no one can answer 429; above the scheduler's capacity, the replica itself answers 429 at once (OpenAI's
    error body, which clients retry), and `/health` and `/v1/models` still get through."""
    return 2 * (max_batch + max_waiting)


def build_ray_app(
    folder: str,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float | None = None,
    runtime_env: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    app_options: dict[str, Any] | None = None,
    **options: Any,
):
    """The Ray Serve application (a bound deployment) of `replicas` replicas serving `folder`.

    Each replica reserves `cpus_per_replica` CPUs and `gpus_per_replica` GPUs (default: 1 when `options` ask for
    `provider="cuda"`, else 0), runs in `runtime_env` (Ray's runtime environment: `env_vars`, `pip`,
    `working_dir`, ...), and is sent at most `max_ongoing_requests` requests at once (default:
    `replica_max_ongoing_requests`, so that the scheduler's own queue limit, and its 429, is reached). `app_options`
    go to each replica's `create_app` (`api_key`, `allowed_origins`, `max_body_bytes`, `request_timeout`), `options`
    to `load_service` (`threads` defaults to the CPUs reserved).

        >>> app = build_ray_app("onnx-folder", replicas=2, provider="cuda")    # one GPU per replica
    """
    from ray import serve

    if replicas < 1 or cpus_per_replica <= 0:
        raise ValueError("replicas must be at least 1 and cpus_per_replica positive.")
    if gpus_per_replica is None:
        gpus_per_replica = 1.0 if options.get("provider") == "cuda" else 0.0
    if gpus_per_replica < 0:
        raise ValueError("gpus_per_replica must be 0 or more.")
    if gpus_per_replica == 0 and options.get("provider") == "cuda":
        raise ValueError("--device cuda needs a GPU per replica: pass --gpus-per-replica above 0 (default 1).")
    if max_ongoing_requests is None:
        max_ongoing_requests = replica_max_ongoing_requests(
            options.get("max_batch", 16), options.get("max_waiting", 64)
        )
    if max_ongoing_requests < 1:
        raise ValueError("max_ongoing_requests must be at least 1.")
    options = {**options, "threads": options.get("threads") or max(1, int(cpus_per_replica))}
    actor_options: dict[str, Any] = {"num_cpus": cpus_per_replica}
    if gpus_per_replica:
        actor_options["num_gpus"] = gpus_per_replica
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    deployment = serve.deployment(
        serve.ingress()(VaswaniReplica),
        name="vaswani",
        num_replicas=replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=max_ongoing_requests,
    )
    return deployment.bind(folder, options, app_options or {})


def application_name(folder: str, model_name: str | None = None) -> str:
    """The default Ray application name of a served model: its model id (`--model-name`, else the folder's name),
    with anything but letters, digits, '-', '_' and '.' replaced by '-'."""
    name = model_name or Path(folder.rstrip("/")).name or "vaswani"
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def load_runtime_env(value: str | None) -> dict[str, Any] | None:
    """`--runtime-env`: a JSON object given inline, or the path of a JSON or YAML file holding one."""
    if not value:
        return None
    path = Path(value)
    if not value.lstrip().startswith("{") and path.is_file():
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml  # a dependency of ray

            runtime_env = yaml.safe_load(text)
        else:
            runtime_env = json.loads(text)
    else:
        try:
            runtime_env = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--runtime-env {value!r} is neither a JSON object nor an existing file ({error})."
            ) from None
    if not isinstance(runtime_env, dict):
        raise ValueError(
            f"--runtime-env must hold a JSON object (Ray's runtime_env), not {type(runtime_env).__name__}."
        )
    return runtime_env


def refuse_taken_name(name: str) -> None:
    """Raise if an application named `name` already runs on the connected Ray cluster: `serve.run` would replace it
    silently (another model, served by someone else)."""
    from ray import serve

    if name in serve.status().applications:
        raise ValueError(
            f"an application named {name!r} is already running on this Ray cluster; pass --ray-app-name to serve "
            "this model beside it, or stop that one first."
        )


def deploy(app, name: str, route_prefix: str = "/") -> None:
    """Run the application `app` as `name` under `route_prefix` on the connected Ray cluster; a route prefix that
    another application holds is a ValueError that names the option to change."""
    from ray import serve

    try:
        serve.run(app, name=name, route_prefix=route_prefix)
    except Exception as error:  # Ray's RayServeException: route prefix taken, or a replica failed to start
        if "is being used by application" in str(error):
            raise ValueError(f"{error} Pass --route-prefix /{name} to serve this model beside it.") from None
        raise


def serve_with_ray(
    folder: str,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    app_name: str | None = None,
    route_prefix: str = "/",
    gpus_per_replica: float | None = None,
    runtime_env: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    app_options: dict[str, Any] | None = None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    **options: Any,
) -> None:
    """Start (or join, with `address`, e.g. "auto") a Ray cluster, run the app on it as `app_name` (default: the
    model's name) under `route_prefix`, and serve HTTP on `host:port` (HTTPS with `ssl_keyfile` and `ssl_certfile`,
    through Ray's proxy) until interrupted; then delete this application only (other applications on a shared
    cluster keep running). `app_options` go to each replica's `create_app` (the API key, CORS, body limit, request
    timeout)."""
    import ray
    from ray import serve

    name = app_name or application_name(folder, options.get("name"))
    app = build_ray_app(
        folder, replicas, cpus_per_replica, gpus_per_replica, runtime_env, max_ongoing_requests, app_options, **options
    )
    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    # SIGTERM (a process manager, `timeout`) stops this application as Ctrl-C does, also while it is deploying.
    signal.signal(signal.SIGTERM, _interrupt)
    owned = False  # from the moment serve.run may have created it, this application is ours to delete
    try:
        tls = {"ssl_keyfile": ssl_keyfile, "ssl_certfile": ssl_certfile} if ssl_keyfile else {}
        serve.start(http_options={"host": host, "port": port, **tls})
        refuse_taken_name(name)
        owned = True
        deploy(app, name, route_prefix)
        where = f"http://{host}:{port}{'' if route_prefix == '/' else route_prefix}"
        print(
            f"vaswani serve: {replicas} replica(s) of {folder} as Ray application {name!r} on {where} (Ctrl-C to stop)",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if owned and name in serve.status().applications:
            serve.delete(name)  # this application only: serve.shutdown() would stop every one on a shared cluster
        ray.shutdown()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
