"""A prefixd cluster on one machine, on loopback ports: redis-server, N
prefixd nodes (deploy/cluster/node.conf with their own port and store) and
HAProxy with deploy/cluster/haproxy.cfg, for tests/cluster/test_cluster.py
and tools/cluster-bench.py. Python standard library only.

    with LocalCluster(prefixd, model, workdir, n_nodes=3) as c:
        c.start_all()
        status, headers, body = c.request(c.proxy_port, "POST", "/v1/completions", {...})
"""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN_TOKEN = "cluster-admin-t0ken"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def request(port, method, path, body=None, headers=None, timeout=60.0):
    """(status, headers dict with lower-case names, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        raw = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return r.status, hdrs, parsed
    finally:
        conn.close()


def metrics(port):
    """{series: value} of GET /metrics."""
    status, _, text = request(port, "GET", "/metrics")
    out = {}
    if status != 200 or not isinstance(text, str):
        return out
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def wait_until(cond, seconds, step=0.02):
    end = time.monotonic() + seconds
    while True:
        if cond():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(step)


class LocalCluster:
    def __init__(self, prefixd, model, workdir, n_nodes=3, node_sets=(), haproxy_cfg=None):
        self.prefixd, self.model, self.dir, self.n = prefixd, model, workdir, n_nodes
        self.node_sets = list(node_sets)
        self.haproxy_cfg = haproxy_cfg or os.path.join(ROOT, "deploy", "cluster", "haproxy.cfg")
        self.redis_port = free_port()
        self.node_ports = [free_port() for _ in range(n_nodes)]
        self.proxy_port = free_port()
        self.redis = None
        self.nodes = [None] * n_nodes
        self.proxy = None

    # ---- processes -----------------------------------------------------------
    def start_redis(self):
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=open(os.path.join(self.dir, "redis.log"), "ab"), stderr=subprocess.STDOUT)
        ok = wait_until(lambda: subprocess.run(["redis-cli", "-p", str(self.redis_port), "ping"],
                                               capture_output=True, text=True).stdout.strip() == "PONG", 10)
        if not ok:
            raise RuntimeError("redis-server did not start")

    def stop_redis(self):
        if self.redis:
            self.redis.kill()
            self.redis.wait()
            self.redis = None

    def node_log(self, i):
        return os.path.join(self.dir, "node%d.log" % (i + 1))

    def start_node(self, i):
        args = [self.prefixd, "--config", os.path.join(ROOT, "deploy", "cluster", "node.conf"),
                "--set", "model.path=" + self.model,
                "--set", "server.listen=127.0.0.1",
                "--set", "server.port=%d" % self.node_ports[i],
                "--set", "admin.token=" + ADMIN_TOKEN,
                "--set", "cache.path=" + os.path.join(self.dir, "node%d" % (i + 1)),
                "--set", "cache.map_size_mb=256",
                "--set", "cluster.redis_url=redis://127.0.0.1:%d/0" % self.redis_port,
                "--set", "model.n_threads=1"]
        for s in self.node_sets:
            args += ["--set", s]
        self.nodes[i] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.node_log(i), "ab"))
        port = self.node_ports[i]

        def healthy():
            if self.nodes[i].poll() is not None:
                raise RuntimeError("node %d exited: %s" % (i + 1, open(self.node_log(i)).read()[-2000:]))
            try:
                return request(port, "GET", "/health", timeout=2)[0] == 200
            except OSError:
                return False
        if not wait_until(healthy, 30, 0.05):
            raise RuntimeError("node %d never became healthy" % (i + 1))

    def stop_node(self, i, sig=signal.SIGTERM):
        p = self.nodes[i]
        if p and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.nodes[i] = None

    def start_proxy(self):
        env = dict(os.environ)
        env["PREFIXD_LISTEN"] = "127.0.0.1:%d" % self.proxy_port
        env["PREFIXD_ERRORS"] = os.path.join(ROOT, "deploy", "haproxy", "errors")
        for i in range(3):  # the shipped config names three nodes
            env["PREFIXD_NODE%d" % (i + 1)] = "127.0.0.1:%d" % self.node_ports[min(i, self.n - 1)]
        self.proxy = subprocess.Popen(["haproxy", "-db", "-f", self.haproxy_cfg], env=env,
                                      stdout=open(os.path.join(self.dir, "haproxy.log"), "ab"),
                                      stderr=subprocess.STDOUT)

        def up():
            if self.proxy.poll() is not None:
                raise RuntimeError("haproxy exited: " + open(os.path.join(self.dir, "haproxy.log")).read()[-2000:])
            try:
                return request(self.proxy_port, "GET", "/health", timeout=2)[0] == 200
            except OSError:
                return False
        if not wait_until(up, 15, 0.05):
            raise RuntimeError("haproxy never answered")

    def start_all(self):
        self.start_redis()
        for i in range(self.n):
            self.start_node(i)
        self.start_proxy()

    def close(self):
        if self.proxy and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait()
        for i in range(self.n):
            if self.nodes[i] and self.nodes[i].poll() is None:
                self.nodes[i].kill()
                self.nodes[i].wait()
        self.stop_redis()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the APIs --------------------------------------------------------------
    def register(self, i, text, **extra):
        body = {"text": text, "wait": True}
        body.update(extra)
        return request(self.node_ports[i], "POST", "/admin/v1/prefixes", body,
                       {"Authorization": "Bearer " + ADMIN_TOKEN})

    def delete(self, i, prefix_id):
        return request(self.node_ports[i], "DELETE", "/admin/v1/prefixes/" + prefix_id, None,
                       {"Authorization": "Bearer " + ADMIN_TOKEN})


def tools_present():
    return all(shutil.which(t) for t in ("redis-server", "redis-cli", "haproxy"))
