#!/usr/bin/env python3
"""A prefixd cluster on one machine (issue "Beyond one machine"): redis-server,
three prefixd nodes and HAProxy with deploy/cluster/haproxy.cfg, all on
loopback ports, all stopped at the end. In order:

  shared      a prefix registered on node 1 serves a request that HAProxy
              routes to node 3 (cached_tokens > 0) with no job run on node 3;
              one routing key always lands on one node
  delete      a delete on node 2 makes every node miss within a second
  kill        SIGKILL of node 2 under load: only requests in flight on
              node 2 may fail (HAProxy replays those it had not begun to
              answer); every request sent after it died succeeds
  redis_down  with Redis stopped, every live node serves and registers
  tls         Redis with TLS and a password, reached through
              deploy/cluster/redis-tls-tunnel.cfg: a prefix registered on one
              node serves another

Exit 0 when all pass, 1 otherwise, 77 (skip) without redis-server, haproxy
or the shared models, except under CI=true, where that is a failure.

  tests/cluster/test_cluster.py [--prefixd build/prefixd] [--model M.gguf] [--keep]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from localcluster import ADMIN_TOKEN, ROOT, LocalCluster, free_port, metrics, request, tools_present, wait_until  # noqa: E402,E501

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "sunshine. One day, she saw a big tree with a red ball in it. She wanted the ball very much.")


def completion(port, prompt, key=None, max_tokens=4):
    headers = {"X-Prefix-Key": key} if key else {}
    return request(port, "POST", "/v1/completions",
                   {"model": "test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, headers)


def registered_tokens(body):
    """cached_tokens when a registered prefix served the request, else 0."""
    if not isinstance(body, dict):
        return 0
    kind = (body.get("prefix") or {}).get("kind")
    return body["usage"]["prompt_tokens_details"]["cached_tokens"] if kind == "registered" else 0


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def test_shared(c, state):
    status, _, body = c.register(0, STORY, policy="knorm", retention=0.5)
    check(status == 201, "registration on node 1: %s %s" % (status, body))
    state["id"] = body["prefix"]["id"]
    prompt = STORY + " Then"
    # Find a routing key HAProxy sends to node 3: every answer on the way is
    # a real check (nodes 2 and 3 start with empty stores).
    key = None
    for k in range(200):
        status, headers, body = completion(c.proxy_port, prompt, "tenant-%d" % k, max_tokens=1)
        check(status == 200, "through HAProxy: %s %s" % (status, body))
        check(registered_tokens(body) > 0, "node %s answered without the prefix: %s" % (headers.get("x-served-by"), body))
        if headers.get("x-served-by") == "node3":
            key = "tenant-%d" % k
            break
    check(key, "no key of 200 was routed to node3")
    for _ in range(5):
        # Bounded load (hash-balance-factor 150) spills a request while the
        # key's node still counts one: HAProxy may not have closed the
        # previous request's stream yet (seen once in a clean-clone .ci/run here).
        # Once the node is idle again the key must land on it.
        for _attempt in range(3):
            _, headers, _ = completion(c.proxy_port, prompt, key, max_tokens=1)
            if headers.get("x-served-by") == "node3":
                break
            time.sleep(0.2)
        check(headers.get("x-served-by") == "node3", "key %s moved to %s" % (key, headers.get("x-served-by")))
    m3 = metrics(c.node_ports[2])
    check(m3.get('prefixd_prefix_jobs_total{state="done"}', -1) == 0, "node 3 ran a job: %s" % m3)
    check(m3.get("prefixd_cluster_fetched_total") == 1, "node 3 fetched %s" % m3.get("prefixd_cluster_fetched_total"))
    m1 = metrics(c.node_ports[0])
    check(m1.get("prefixd_cluster_published_total") == 1, "node 1 published %s" % m1)
    status, _, body = request(c.node_ports[1], "GET", "/admin/v1/shared/prefixes", None,
                              {"Authorization": "Bearer " + ADMIN_TOKEN})
    check(status == 200 and [p["id"] for p in body["data"]] == [state["id"]], "the shared list: %s" % body)


def test_delete(c, state):
    prompt = STORY + " Then"
    for i in range(3):  # every node holds it (nodes 1 and 2 through direct requests)
        status, _, body = completion(c.node_ports[i], prompt, max_tokens=1)
        check(registered_tokens(body) > 0, "node %d before the delete: %s" % (i + 1, body))
    t0 = time.monotonic()
    status, _, body = c.delete(1, state["id"])
    check(status == 204, "delete on node 2: %s %s" % (status, body))
    for i in range(3):
        ok = wait_until(lambda: registered_tokens(completion(c.node_ports[i], prompt, max_tokens=1)[2]) == 0,
                        max(0.0, 1.0 - (time.monotonic() - t0)))
        check(ok, "node %d still served the deleted prefix 1 s after the delete" % (i + 1))
    status, _, _ = c.delete(2, state["id"])
    check(status == 404, "a second delete (node 3): %s" % status)
    # Registered again for what follows.
    status, _, body = c.register(0, STORY, policy="knorm", retention=0.5)
    check(status == 201, "registering again: %s %s" % (status, body))


def test_kill(c, state):
    prompt = STORY + " Then"
    results = []  # (start, end, status)
    lock = threading.Lock()
    stop = threading.Event()

    def client(n):
        k = 0
        while not stop.is_set():
            key = "load-%d-%d" % (n, k)
            k += 1
            t = time.monotonic()
            try:
                status = completion(c.proxy_port, prompt, key, max_tokens=8)[0]
            except OSError:
                status = -1
            with lock:
                results.append((t, time.monotonic(), status))
    threads = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    kill_at = time.monotonic()
    c.nodes[1].kill()
    c.nodes[1].wait()
    dead_at = time.monotonic()  # SIGKILL takes a moment: node 2 still accepts until here
    time.sleep(3.0)  # past HAProxy's two failed checks (1 s apart)
    stop.set()
    for t in threads:
        t.join()
    failed = [r for r in results if r[2] != 200]
    after = [r for r in results if r[0] > dead_at]
    check(len(after) >= 6, "only %d requests after the kill" % len(after))
    check(all(r[2] == 200 for r in after), "requests sent after the kill failed: %s" %
          [r[2] for r in after if r[2] != 200])
    check(len(failed) <= 6, "%d requests failed; at most the 6 in flight may" % len(failed))
    check(all(r[0] <= dead_at and r[1] >= kill_at for r in failed), "a failed request was not in flight at the kill")
    print("  kill: %d requests, %d after the kill, %d failed (in flight on node 2, not replayed)" %
          (len(results), len(after), len(failed)))


def test_redis_down(c, state):
    c.stop_redis()
    prompt = STORY + " And"
    for i in (0, 2):
        status, _, body = completion(c.node_ports[i], prompt, max_tokens=2)
        check(status == 200, "node %d without Redis: %s %s" % (i + 1, status, body))
    for k in range(6):
        status, _, body = completion(c.proxy_port, prompt, "redis-down-%d" % k, max_tokens=2)
        check(status == 200, "through HAProxy without Redis: %s %s" % (status, body))
    status, _, body = c.register(0, STORY + " The sun was warm.", policy="knorm", retention=0.5)
    check(status == 201, "a registration without Redis: %s %s" % (status, body))
    check(metrics(c.node_ports[0]).get("prefixd_cluster_up") == 0, "prefixd_cluster_up is not 0 on node 1")


def test_tls(c, state, prefixd, model, workdir, sets):
    """Redis over TLS through deploy/cluster/redis-tls-tunnel.cfg, with AUTH:
    a prefix registered on one node serves another."""
    if not shutil.which("openssl"):
        raise AssertionError("openssl is needed to make the test certificate")
    tdir = os.path.join(workdir, "tls")
    os.makedirs(tdir)
    key, cert = os.path.join(tdir, "key.pem"), os.path.join(tdir, "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    tls_port, tunnel_port = free_port(), free_port()
    password = "tls-s3cret"
    procs = []
    try:
        procs.append(subprocess.Popen(
            ["redis-server", "--port", "0", "--tls-port", str(tls_port), "--bind", "127.0.0.1",
             "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no",
             "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", tdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        env = dict(os.environ, REDIS_TUNNEL_LISTEN="127.0.0.1:%d" % tunnel_port,
                   REDIS_TLS_ADDR="127.0.0.1:%d" % tls_port, REDIS_CA=cert, REDIS_NAME="localhost")
        procs.append(subprocess.Popen(["haproxy", "-db", "-f", os.path.join(ROOT, "deploy", "cluster",
                                                                          "redis-tls-tunnel.cfg")],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def answers():
            r = subprocess.run(["redis-cli", "-p", str(tunnel_port), "--no-auth-warning", "-a", password, "ping"],
                               capture_output=True, text=True)
            return r.stdout.strip() == "PONG"
        check(wait_until(answers, 10, 0.1), "Redis does not answer through the TLS tunnel")
        with LocalCluster(prefixd, model, tdir, 2, sets + ["cluster.password=" + password]) as t:
            t.redis_port = tunnel_port  # the nodes talk to the tunnel
            t.start_node(0)
            t.start_node(1)
            status, _, body = t.register(0, STORY, policy="knorm", retention=0.5)
            check(status == 201, "registration over TLS: %s %s" % (status, body))
            status, _, body = completion(t.node_ports[1], STORY + " Then", max_tokens=1)
            check(registered_tokens(body) > 0, "node 2 did not get the prefix over TLS: %s" % body)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixd", default=os.environ.get("PD_PREFIXD", "build/prefixd"))
    ap.add_argument("--model")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    strict = os.environ.get("CI") == "true"
    model = a.model or os.path.join(os.environ.get("PD_SHARED_MODELS", "../shared/models"),
                                    "tinystories", "stories260K.gguf")
    missing = None if tools_present() else "redis-server, redis-cli or haproxy is not installed"
    if not missing and not os.path.exists(model):
        missing = "the model %s is absent" % model
    if missing:
        print("SKIP: " + missing)
        return 1 if strict else 77
    workdir = tempfile.mkdtemp(prefix="prefixd-cluster-")
    sets = ["server.model_names=test", "cache.auto_mb=0", "compression.min_prefix_tokens=8",
            "cache.hot_tier_mb=16"]
    failures = 0
    state = {}
    try:
        with LocalCluster(a.prefixd, model, workdir, 3, sets) as c:
            c.start_all()
            tls = lambda c, state: test_tls(c, state, a.prefixd, model, workdir, sets)  # noqa: E731
            for name, fn in (("shared", test_shared), ("delete", test_delete), ("kill", test_kill),
                             ("redis_down", test_redis_down), ("tls", tls)):
                t = time.monotonic()
                try:
                    fn(c, state)
                    print("PASS %s (%.1f s)" % (name, time.monotonic() - t))
                except Exception as e:  # noqa: BLE001 (report and stop: later steps build on earlier)
                    failures += 1
                    print("FAIL %s: %s" % (name, e))
                    for i in range(3):
                        log = c.node_log(i)
                        if os.path.exists(log):
                            print("--- node %d log (tail) ---\n%s" % (i + 1, open(log).read()[-1500:]))
                    break
    finally:
        if a.keep:
            print("kept", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
