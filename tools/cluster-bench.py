#!/usr/bin/env python3
"""cluster-bench: prefix-affinity routing against round-robin, on a 3-node
prefixd cluster on this machine (redis-server, three prefixd, HAProxy with
deploy/cluster/haproxy.cfg; tests/cluster/localcluster.py starts them).

The workload: --prefixes system prompts of ~--prefix-words words, registered
on node 1 (so every node fetches them from Redis on first use), then
--requests streamed completions from --clients concurrent clients, each
picking a prefix with Zipf(--zipf) popularity and a fresh random question
after it, with X-Prefix-Key set to the prefix's name. Each node's hot tier
holds --hot-mb MiB, about a third of all the prefixes; the automatic block
cache is off (cache.auto_mb = 0) so that what is measured is the tier
holding the compressed prefixes.

Modes: "affinity" is deploy/cluster/haproxy.cfg as shipped (consistent hash
of X-Prefix-Key with bounded load); "roundrobin" is the same file with
`balance roundrobin`; "affinity-unbounded" drops its hash-balance-factor.
The modes alternate (in turn forwards and backwards) for --rounds rounds, each with fresh stores, so the
machine's noise falls on both. Printed per run and as the median per mode:
time to first token p50/p99 (seconds, measured by the client), the hot-tier
hit rate over the three nodes, and the records fetched from Redis.

  tools/cluster-bench.py --prefixd build/prefixd --prefixctl build/tools/prefixctl
                         [--model M.gguf] [--rounds 2] [--requests 400] ...

Python 3 standard library only.
"""
import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
from localcluster import LocalCluster, metrics, tools_present  # noqa: E402

WORDS = ("the a little girl boy dog cat tree ball house garden river sun moon star bird fish red blue green "
         "big small happy sad ran jumped played saw found loved wanted gave took made said asked went came "
         "friend mother father sister brother park school forest road hill sky rain snow day night morning").split()


def text_of(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def ttft(port, key, prompt, max_tokens):
    """Seconds from sending the request to the first SSE event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0})
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json", "X-Prefix-Key": key})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError("status %d: %s" % (r.status, r.read()[:300]))
    first = None
    while True:
        line = r.readline()
        if not line:
            break
        if first is None and line.startswith(b"data: "):
            first = time.monotonic() - t0
        if line.strip() == b"data: [DONE]":
            break
    conn.close()
    return first


def zipf_weights(n, s):
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


# mode -> (lines of deploy/cluster/haproxy.cfg's affinity backend, what replaces them)
MODES = {
    "affinity": None,  # the file as shipped
    "roundrobin": ("    balance hash var(txn.route_key)\n    hash-type consistent\n", "    balance roundrobin\n"),
    "affinity-unbounded": ("    hash-balance-factor 150\n", ""),
}


def mode_cfg(workdir, mode):
    """deploy/cluster/haproxy.cfg changed for `mode` (None: as shipped)."""
    if MODES[mode] is None:
        return None
    old, new = MODES[mode]
    src = open(os.path.join(ROOT, "deploy", "cluster", "haproxy.cfg")).read()
    if old not in src:
        raise SystemExit("deploy/cluster/haproxy.cfg no longer has the lines mode %s replaces" % mode)
    path = os.path.join(workdir, "haproxy-%s.cfg" % mode)
    open(path, "w").write(src.replace(old, new))
    return path


def run(a, mode, model, workdir, prefixes, schedule):
    cfg = mode_cfg(workdir, mode)
    sets = ["server.model_names=bench", "cache.auto_mb=0", "cache.hot_tier_mb=%d" % a.hot_mb,
            "compression.min_prefix_tokens=8", "scheduler.max_batch=8"]
    rundir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    with LocalCluster(a.prefixd, model, rundir, 3, sets, haproxy_cfg=cfg) as c:
        c.start_all()
        for name, text in prefixes:
            status, _, body = c.register(0, text, policy="knorm", retention=a.retention)
            if status != 201:
                raise SystemExit("registering %s: %s %s" % (name, status, body))
        before = [metrics(p) for p in c.node_ports]
        times, lock, it = [], threading.Lock(), iter(schedule)

        def client():
            while True:
                with lock:
                    job = next(it, None)
                if job is None:
                    return
                name, prompt = job
                t = ttft(c.proxy_port, name, prompt, a.gen)
                with lock:
                    times.append(t)
        threads = [threading.Thread(target=client) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = [metrics(p) for p in c.node_ports]

    def delta(series):
        return sum(m.get(series, 0) - b.get(series, 0) for m, b in zip(after, before))
    hits, misses = delta("prefixd_hot_tier_hits_total"), delta("prefixd_hot_tier_misses_total")
    shutil.rmtree(rundir, ignore_errors=True)
    return {"p50": percentile(times, 50), "p99": percentile(times, 99),
            "hit_rate": hits / (hits + misses) if hits + misses else float("nan"),
            "fetched": delta("prefixd_cluster_fetched_total"), "n": len(times)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixd", default="build/prefixd")
    ap.add_argument("--prefixctl", default="build/tools/prefixctl")
    ap.add_argument("--model", help="default: a 6-layer SmolLM2-135M-shaped q8_0 model, generated")
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--question-words", type=int, default=12)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--gen", type=int, default=2, help="tokens generated per request")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--hot-mb", type=int, default=2)
    ap.add_argument("--retention", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="affinity,roundrobin",
                    help="comma-separated, alternated: " + ", ".join(MODES))
    a = ap.parse_args()
    if not tools_present():
        raise SystemExit("redis-server, redis-cli and haproxy are needed (deploy/install-deps.sh)")
    workdir = tempfile.mkdtemp(prefix="prefixd-cluster-bench-")
    try:
        model = a.model
        if not model:
            vocab = os.path.join(os.environ.get("PD_SHARED_MODELS", os.path.join(ROOT, "..", "shared", "models")),
                                 "vocab", "ggml-vocab-llama-spm.gguf")
            model = os.path.join(workdir, "model.gguf")
            subprocess.run([a.prefixctl, "gen-model", "--preset", "smollm2-135m", "--n-layer", "6", "--type", "q8_0",
                            "--vocab-from", vocab, "-q", "-o", model], check=True)
        rng = random.Random(a.seed)
        prefixes = [("prefix-%02d" % i, "System prompt %d. " % i + text_of(rng, a.prefix_words))
                    for i in range(a.prefixes)]
        weights = zipf_weights(a.prefixes, a.zipf)
        schedule = []
        for _ in range(a.requests):
            name, text = rng.choices(prefixes, weights)[0]
            schedule.append((name, text + " Question: " + text_of(rng, a.question_words)))
        print("cluster-bench: 3 nodes, %d prefixes of ~%d words (Zipf %.2f), %d requests from %d clients, "
              "hot tier %d MiB per node, retention %.2f" % (a.prefixes, a.prefix_words, a.zipf, a.requests,
                                                             a.clients, a.hot_mb, a.retention))
        modes = a.modes.split(",")
        for m in modes:
            if m not in MODES:
                raise SystemExit("unknown mode %s (%s)" % (m, ", ".join(MODES)))
        results = {m: [] for m in modes}
        for r in range(a.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                res = run(a, mode, model, workdir, prefixes, schedule)
                results[mode].append(res)
                print("round %d %-10s  TTFT p50 %.4f s  p99 %.4f s  hot-tier hit rate %.3f  fetched from Redis %d" %
                      (r + 1, mode, res["p50"], res["p99"], res["hit_rate"], res["fetched"]), flush=True)
        print("\nmedian over %d rounds:" % a.rounds)
        print("| routing | TTFT p50 (s) | TTFT p99 (s) | hot-tier hit rate | records fetched from Redis |")
        print("|---|---|---|---|---|")
        for mode, rs in results.items():
            print("| %s | %.4f | %.4f | %.3f | %d |" % (
                mode, statistics.median(x["p50"] for x in rs), statistics.median(x["p99"] for x in rs),
                statistics.median(x["hit_rate"] for x in rs), statistics.median(x["fetched"] for x in rs)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
