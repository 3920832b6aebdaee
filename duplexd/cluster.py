"""`duplexd cluster`: N `duplexd serve` processes behind HAProxy, on one machine, to try scale-out.

Operators grow WebSocket services with an L7 balancer in front of identical processes; duplexd needs only
three things from it, all in the configuration `haproxy_config` writes (and `deploy/haproxy.cfg` shows):

- **Pass-through**: HAProxy forwards the WebSocket upgrade and then tunnels the connection (`timeout
  tunnel`), least connections first.
- **Readiness**: an active check of each process's `/readyz` every `check_ms`. A process that is full (its
  admission controller says no) or draining answers 503 and is taken out of rotation for *new* sessions
  only; its open sessions go on.
- **Resume reaches the owner**: `session.started.node` names the process; a client resuming after a drop
  reconnects with `?node=NAME`, and `use-server %[urlp(node)]` + `force-persist` send it to that process,
  even while it is out of rotation because it is full. If the process is gone, HAProxy redispatches the
  connection to another, which answers `resume_refused`: the client starts a new session.

The same `?node=` reaches one process's `/healthz` or `/metrics` through the balancer. `option forwardfor`
and the workers' `security.trusted_proxies` keep the per-address limit about clients, not about HAProxy.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from duplexd.netutil import free_ports, http_json, ready_health

DEFAULT_CHECK_MS = 500
SCRAPED = (
    "duplexd_sessions_admitted_total",
    "duplexd_sessions_refused_total",
    "duplexd_sessions_active",
    "duplexd_frame_deadline_misses_total",
    "duplexd_frame_lag_seconds_count",
    "duplexd_frame_lag_seconds_sum",
)


class ClusterError(RuntimeError):
    """A cluster could not be started (no HAProxy, a worker that died, a bad configuration)."""


@dataclass(frozen=True, slots=True)
class Worker:
    node: str
    host: str
    port: int


def haproxy_config(
    workers: list[Worker], *, host: str, port: int, stats_port: int | None = None, check_ms: int = DEFAULT_CHECK_MS
) -> str:
    """The balancer's configuration for `workers` (HAProxy 2.2 or later), listening on `host:port`;
    with `stats_port`, HAProxy's statistics (HTML, and CSV at `/;csv`) there."""
    servers = "\n".join(f"    server {w.node} {w.host}:{w.port}" for w in workers)
    stats = (
        f"""
frontend stats
    bind {host}:{stats_port}
    stats enable
    stats uri /
    stats refresh 5s
"""
        if stats_port is not None
        else ""
    )
    return f"""# duplexd behind HAProxy: written by `duplexd cluster` (see duplexd/cluster.py and docs/deploy.md).
global
    # Each client is two file descriptors here (its side and the worker's): keep within `ulimit -n`.
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
    # An upgraded WebSocket is a tunnel: it may stay quiet this long (duplexd's own idle timeout,
    # security.idle_timeout_s, is shorter and answers with a proper close).
    timeout tunnel 1h
    timeout client-fin 5s
    timeout http-request 10s
    timeout queue 5s

frontend duplexd
    bind {host}:{port}
    option forwardfor
    default_backend workers

backend workers
    balance leastconn
    # A full or draining process answers 503 on /readyz: no new sessions go to it; open ones go on.
    option httpchk GET /readyz
    http-check expect status 200
    default-server check inter {check_ms}ms fastinter {check_ms}ms downinter {check_ms}ms rise 1 fall 1
    # ?node=NAME (a resume, or one process's /healthz or /metrics) goes to that process, even while it is
    # out of rotation because it is full; if it is gone, the connection is redispatched and the process
    # that gets it refuses the resume (the client starts a new session).
    force-persist if {{ urlp(node) -m found }}
    use-server %[urlp(node)] if {{ urlp(node) -m found }}
    option redispatch
    retries 1
{servers}
{stats}"""


def scrape_metrics(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The unlabelled samples named `names` in the Prometheus text at `url`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names and not sample.labels
    }


class Cluster:
    """`workers` `duplexd serve` processes (w1, w2, ...) and one HAProxy in front of them. A context
    manager: everything is started (and every worker ready) on entry, stopped on exit.

    `serve_args`: extra `duplexd serve` arguments (`--no-dialog`, `--config F`); `env`: settings for every
    worker (`DUPLEXD_SECTION__KEY`). Each worker gets `cpus // workers` threads per engine (at least 1): N
    processes that each think they own every core slow one another down."""

    def __init__(
        self,
        workers: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        base_port: int = 0,
        stats_port: int | None = 0,
        serve_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        check_ms: int = DEFAULT_CHECK_MS,
        run_dir: Path | None = None,
        timeout_s: float = 180.0,
    ) -> None:
        if workers < 1:
            raise ClusterError("a cluster needs at least one worker")
        self.host = host
        fresh = iter(free_ports(2 + workers, host))  # (distinct: the balancer's two listeners and every worker)
        self.port = port or next(fresh)
        self.stats_port = None if stats_port is None else (stats_port or next(fresh))
        self.workers = [
            Worker(f"w{i + 1}", host, base_port + i + 1 if base_port else next(fresh)) for i in range(workers)
        ]
        self.serve_args = list(serve_args or [])
        self.env = dict(env or {})
        self.check_ms = check_ms
        self.timeout_s = timeout_s
        self._tmp = None if run_dir is not None else tempfile.TemporaryDirectory(prefix="duplexd-cluster-")
        self.run_dir = run_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.balancer: subprocess.Popen[bytes] | None = None
        self._stopped: frozenset[str] = frozenset()  # workers stopped on purpose (not a failure)

    # where things are

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/stream"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

    def worker(self, node: str) -> Worker:
        return next(w for w in self.workers if w.node == node)

    def log_path(self, node: str) -> Path:
        return self.run_dir / f"{node}.log"

    @property
    def config_path(self) -> Path:
        return self.run_dir / "haproxy.cfg"

    def config(self) -> str:
        return haproxy_config(
            self.workers, host=self.host, port=self.port, stats_port=self.stats_port, check_ms=self.check_ms
        )

    # life

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            raise ClusterError("haproxy is not installed (Debian: apt-get install haproxy)")
        threads = str(max(1, (os.cpu_count() or 1) // len(self.workers)))
        for w in self.workers:  # all at once: each loads its models while the others do
            env = {
                **os.environ,
                "DUPLEXD_ASR__CPU_THREADS": threads,
                "DUPLEXD_DIALOG__THREADS": threads,
                **self.env,
                "DUPLEXD_TRANSPORT__NODE": w.node,
                "DUPLEXD_SECURITY__TRUSTED_PROXIES": self.host,
            }
            log = open(self.log_path(w.node), "wb")
            self._logs.append(log)
            cmd = [sys.executable, "-m", "duplexd", "serve", "--host", w.host, "--port", str(w.port), *self.serve_args]
            # Own process groups: a Ctrl-C in the terminal reaches only `duplexd cluster`, which drains them.
            self.procs[w.node] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.timeout_s
        for w in self.workers:
            self._wait(lambda w=w: ready_health(f"http://{w.host}:{w.port}/healthz"), deadline, w.node)
        self.config_path.write_text(self.config())
        check = subprocess.run([haproxy, "-c", "-q", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterError(f"haproxy rejected {self.config_path}: {check.stdout}{check.stderr}")
        log = open(self.run_dir / "haproxy.log", "wb")
        self._logs.append(log)
        self.balancer = subprocess.Popen(
            [haproxy, "-db", "-f", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait(lambda: http_json(f"{self.http}/healthz"), deadline, "haproxy")
        if self.stats_port is not None:
            self._wait(self._all_up, deadline, "haproxy's checks")

    def _all_up(self) -> None:
        down = [row["svname"] for row in self.server_stats() if row["status"] != "UP"]
        if down:
            raise OSError(f"not yet up: {down}")

    def _wait(self, probe: Any, deadline: float, name: str) -> None:
        while True:
            for node, proc in self.procs.items():
                if proc.poll() is not None and node not in self._stopped:
                    raise ClusterError(f"worker {node} exited with {proc.returncode}: {self._tail(node)}")
            if self.balancer is not None and self.balancer.poll() is not None:
                raise ClusterError(f"haproxy exited with {self.balancer.returncode}: {self._tail('haproxy')}")
            try:
                probe()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{name} did not come up in {self.timeout_s:.0f} s") from None
                time.sleep(0.2)

    def _tail(self, node: str) -> str:
        with contextlib.suppress(OSError):
            return self.log_path(node).read_text(errors="replace")[-2000:]
        return ""

    def kill(self, node: str) -> None:
        """SIGKILL one worker (a crash: no drain, no closing handshakes)."""
        self._stopped = self._stopped | {node}
        proc = self.procs[node]
        proc.kill()
        proc.wait()

    def terminate_workers(self, timeout_s: float = 60.0) -> None:
        """SIGTERM every worker (each drains: no new sessions, replies finish, sessions closed 1001)."""
        self._stopped = frozenset(self.procs)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        self.terminate_workers()
        if self.balancer is not None and self.balancer.poll() is None:
            self.balancer.terminate()
            try:
                self.balancer.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.balancer.kill()
                self.balancer.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # what the balancer sees

    def server_stats(self) -> list[dict[str, str]]:
        """HAProxy's view of each worker: `svname`, `status` (UP, DOWN, ...), `scur` (connections now),
        `stot` (connections so far), from its CSV statistics."""
        if self.stats_port is None:
            raise ClusterError("this cluster runs without HAProxy's statistics page")
        with urllib.request.urlopen(f"http://{self.host}:{self.stats_port}/;csv", timeout=5) as r:
            text = r.read().decode().lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return [row for row in rows if row["pxname"] == "workers" and row["svname"] not in ("BACKEND", "FRONTEND")]

    def node_health(self, node: str) -> dict[str, Any]:
        """One worker's /healthz, through the balancer (`?node=`)."""
        return http_json(f"{self.http}/healthz?node={node}")

    def scrape(self, names: tuple[str, ...] = SCRAPED) -> dict[str, dict[str, float]]:
        """Every worker's /metrics through the balancer (`?node=`), as {node: {sample name: value}} for the
        unlabelled samples in `names` (what a Prometheus scraping each process sees, side by side)."""
        return {w.node: scrape_metrics(f"{self.http}/metrics?node={w.node}", names) for w in self.workers}


def main(args: argparse.Namespace) -> int:
    """`duplexd cluster`: start, print where, run until Ctrl-C or SIGTERM (the workers drain first)."""
    serve_args = [
        *(["--no-dialog"] if args.dialog is False else []),
        *(["--config", str(args.config)] if args.config else []),
    ]
    cluster = Cluster(
        args.workers,
        host=args.host,
        port=args.port,
        base_port=args.base_port,
        stats_port=args.stats_port,
        serve_args=serve_args,
        check_ms=args.check_ms,
    )
    if args.print_config:
        print(cluster.config(), end="")
        return 0
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with cluster:
            print(f"duplexd cluster: {args.workers} workers behind HAProxy at {cluster.http}/ ({cluster.url})")
            for w in cluster.workers:
                print(f"  {w.node}: http://{w.host}:{w.port}/  log {cluster.log_path(w.node)}")
            if cluster.stats_port is not None:
                print(f"  HAProxy statistics: http://{cluster.host}:{cluster.stats_port}/")
            sys.stdout.flush()
            while not stop:
                time.sleep(0.5)
                dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
                if dead or (cluster.balancer is not None and cluster.balancer.poll() is not None):
                    print(f"duplexd cluster: stopping ({', '.join(dead) or 'haproxy'} exited)", file=sys.stderr)
                    return 1
    except ClusterError as exc:
        print(f"duplexd cluster: {exc}", file=sys.stderr)
        return 1
    return 0
