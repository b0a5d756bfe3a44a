"""`tandem serve`: the engine ranks, the front end and the HTTP server, started and stopped
as one unit.

Local (`--data-parallel-size N`): this process is the front end (HTTP + `ProcessEngineClient`)
and starts N rank processes. Under `torchrun` (one process per rank, env:// rendezvous,
any number of nodes): every process is a rank, and rank 0 also starts the front end as a
child process attached to it by two queues. Either way, SIGTERM or SIGINT, to the head or to
the whole process group, drains the requests in flight (`serving.shutdown`), then stops the
ranks, and no rank process outlives the server.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys

from tandem.config import HttpOptions
from tandem.distributed.torchrun import under_torchrun
from tandem.serving.ranks.lifetime import STOP_SIGNALS, die_with_parent, ignore_stop_signals
from tandem.serving.ranks.rank import ServeOptions


def _log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


def describe(config, options: ServeOptions, http: HttpOptions, world_size: int) -> str:
    return (
        f"serving {config.model} on http://{http.host}:{http.port} | ranks={world_size} {config.describe()} "
        f"auth={'on' if http.api_key else 'off'} step_timeout={config.scheduler.step_timeout_s:g}s"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve_http(client, http: HttpOptions) -> None:
    import uvicorn

    from tandem.serving.openai.api_server import create_app
    from tandem.serving.shutdown import DrainingServer

    if not _is_loopback(http.host) and not http.api_key:
        _log(f"warning: binding {http.host} without --api-key: anyone who can reach this port can use the server")
    app = create_app(
        client,
        api_key=http.api_key,
        served_model_name=http.served_model_name,
        log_requests=http.log_requests,
        max_request_bytes=http.max_request_bytes,
        max_streams_per_key=http.max_streams_per_key,
    )
    config = uvicorn.Config(app, host=http.host, port=http.port, log_level="warning", timeout_graceful_shutdown=5)
    DrainingServer(config, client, http.shutdown_timeout, _log).run()


def _stop_signals_interrupt() -> None:
    """Outside the HTTP server's drain (while the ranks start, or stop), a stop signal is
    KeyboardInterrupt, for SIGTERM as for Ctrl-C: the default SIGTERM would kill the head
    before it stops its ranks."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler)


def run_server(config, options: ServeOptions, http: HttpOptions) -> None:
    """Local mode: start the ranks, serve until a stop signal has drained the requests in
    flight, stop the ranks (they write the trace). A stop signal during start-up stops too."""
    from tandem.platform.memory_probe import start_from_env
    from tandem.serving.ranks.process_client import ProcessEngineClient

    start_from_env("head")
    _stop_signals_interrupt()
    client = ProcessEngineClient(config, options, max_queue_len=http.max_queue_len, log=_log)
    _log(describe(config, options, http, client.world_size))
    try:
        client.start()
        _log(f"ready: http://{http.host}:{http.port}/v1 (model {http.served_model_name or client.model_name})")
        _serve_http(client, http)
    except KeyboardInterrupt:
        _log("stop signal during start-up")
    finally:
        _log("shutting down")
        _stop_ranks(client)


def _stop_ranks(client) -> None:
    """Ask the ranks to stop and join them; a stop signal meanwhile kills them at once."""
    try:
        client.stop()
    except KeyboardInterrupt:
        _log("stop signal while the ranks were stopping: killing them")
        client.kill_ranks()
    _log("stopped")


def _frontend_main(config, options: ServeOptions, http: HttpOptions, queues, world_size: int) -> None:
    from tandem.serving.ranks.process_client import ProcessEngineClient

    _stop_signals_interrupt()

    # No death signal from the head: a head that dies (even by os._exit) is noticed by the
    # client, which answers 503 with the reason for a while and then stops this process.
    client = ProcessEngineClient(
        config, options, max_queue_len=http.max_queue_len, log=_log, queues=queues, world_size=world_size
    )
    try:
        client.start()
        _log(f"ready: http://{http.host}:{http.port}/v1 (model {http.served_model_name or client.model_name})")
        _serve_http(client, http)
    except KeyboardInterrupt:
        _log("stop signal during start-up")
    finally:
        _stop_ranks(client)


def run_torchrun_rank(config, options: ServeOptions, http: HttpOptions) -> None:
    """One rank started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from tandem.distributed.launch import init_rank
    from tandem.serving.ranks.process_client import ATTACHED_FAILURE_LINGER_S
    from tandem.serving.ranks.rank import serve_rank

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun relays a stop signal to each rank's process group (rank 0's holds the front
    # end): the front end drains and tells the ranks to stop; a killed torchrun takes them along.
    ignore_stop_signals()
    die_with_parent(os.getppid())
    if config.parallel.world_size != world_size:
        raise ValueError(
            f"--pipeline-parallel-size {config.parallel.pipeline_parallel_size} x --data-parallel-size "
            f"{config.parallel.data_parallel_size} != torchrun's WORLD_SIZE {world_size}"
        )
    init_rank(rank, world_size, device=config.device, timeout_s=options.collective_timeout_s)
    frontend = None
    failed = False
    try:
        if rank == 0:
            _log(describe(config, options, http, world_size))
            ctx = mp.get_context("spawn")
            queues = (ctx.Queue(), ctx.Queue())
            frontend = ctx.Process(
                target=_frontend_main, args=(config, options, http, queues, world_size), name="tandem-frontend"
            )
            frontend.start()
            serve_rank(0, world_size, config, options, *queues, frontend_alive=frontend.is_alive)
        else:
            serve_rank(rank, world_size, config, options)
    except BaseException:
        failed = True
        raise
    finally:
        if frontend is not None:
            # After an engine failure the front end has reported it (health 503) and is
            # still serving; the rank ends it, so torchrun sees the failure.
            frontend.join(timeout=ATTACHED_FAILURE_LINGER_S + 3 if failed else 10)
            if frontend.is_alive():
                frontend.kill()
        if failed:
            import traceback

            from tandem.serving.ranks.rank import hard_exit

            traceback.print_exc()
            hard_exit(1)  # a forward stuck in a collective would block a normal exit
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["HttpOptions", "describe", "run_server", "run_torchrun_rank", "under_torchrun"]
