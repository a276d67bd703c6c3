#!/usr/bin/env python3
"""slowloris-bench: does prefixd keep serving while hostile clients hold
connections open?

Starts prefixd on a free loopback port, opens SOCKETS connections that send
an HTTP request header one byte at a time (a byte every DRIP seconds, never
finishing it: "slowloris"), and meanwhile measures, every second for
SECONDS seconds:
  - GET /health: status and latency,
  - a short non-streamed completion: status and latency,
then runs STREAMS concurrent streamed completions and checks that each ends
with `data: [DONE]`. It prints the daemon's threads and resident memory
(from /proc) at the peak, and exits 1 when a target is missed: every probe
answered within 1 s, every stream complete.

  tools/slowloris-bench.py --prefixd build/prefixd --model M.gguf \\
      [--sockets 2000] [--seconds 45] [--streams 64] [--set KEY=VALUE ...]

Python 3 standard library only. Needs a file-descriptor limit above SOCKETS
(it raises its own soft limit to the hard one).
"""
import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http(port, method, path, body=None, timeout=10.0):
    """One request on a fresh connection: (status, body bytes, seconds)."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.settimeout(timeout)
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    s.sendall(head.encode() + b"\r\n" + data)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    finally:
        s.close()
    dt = time.monotonic() - t0
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.") else 0
    return status, out, dt


def proc_stats(pid):
    threads = rss_kb = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    threads = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss_kb = int(line.split()[1])
    except OSError:
        pass
    return threads, rss_kb


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixd", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sockets", type=int, default=2000)
    ap.add_argument("--seconds", type=int, default=45)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--drip", type=float, default=5.0, help="seconds between a slow client's bytes")
    ap.add_argument("--set", action="append", default=[], help="extra prefixd --set KEY=VALUE")
    a = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = a.sockets + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        soft = min(want, hard)
    if soft < want:
        print(f"slowloris-bench: the file limit is {soft}; {want} are needed (ulimit -n)", file=sys.stderr)
        return 2

    port = free_port()
    work = tempfile.mkdtemp(prefix="slowloris-")
    log = open(os.path.join(work, "prefixd.log"), "w")
    cmd = [a.prefixd, "--set", f"model.path={a.model}", "--set", f"cache.path={work}/store",
           "--set", f"server.port={port}", "--set", "cache.map_size_mb=64",
           "--set", "server.model_names=x"]
    for kv in a.set:
        cmd += ["--set", kv]
    d = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    ok = True
    try:
        for _ in range(300):
            try:
                if http(port, "GET", "/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            print("slowloris-bench: prefixd did not become healthy", file=sys.stderr)
            return 1
        base_threads, base_rss = proc_stats(d.pid)
        print(f"prefixd pid {d.pid} on port {port}: {base_threads} threads, {base_rss / 1024:.1f} MiB resident at rest")

        # The slow clients.
        slow, refused = [], 0
        t0 = time.monotonic()
        for _ in range(a.sockets):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.setblocking(False)
                s.send(b"G")
                slow.append(s)
            except OSError:
                refused += 1
        print(f"{len(slow)} slow connections open ({refused} refused) in {time.monotonic() - t0:.1f} s")
        stop = threading.Event()
        partial = b"ET /health HTTP/1.1\r\nX-Slow: " + b"a" * 10000

        def drip():
            i = 0
            while not stop.wait(a.drip):
                for s in slow:
                    try:
                        s.send(partial[i % len(partial):i % len(partial) + 1])
                    except OSError:
                        pass
                i += 1

        threading.Thread(target=drip, daemon=True).start()

        worst_health = worst_completion = 0.0
        bad = 0
        peak_threads = peak_rss = 0
        completion = {"model": "x", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        end = time.monotonic() + a.seconds
        n = 0
        while time.monotonic() < end:
            n += 1
            for what, args in (("health", ("GET", "/health")), ("completion", ("POST", "/v1/completions", completion))):
                try:
                    st, _, dt = http(port, *args, timeout=5)
                except OSError as e:
                    st, dt = 0, 5.0
                    print(f"  {what}: {e}")
                if st != 200 or dt > 1.0:
                    bad += 1
                    print(f"  t={a.seconds - (end - time.monotonic()):.0f}s {what}: status {st} in {dt * 1000:.0f} ms")
                if what == "health":
                    worst_health = max(worst_health, dt)
                else:
                    worst_completion = max(worst_completion, dt)
            th, rss = proc_stats(d.pid)
            peak_threads, peak_rss = max(peak_threads, th), max(peak_rss, rss)
            time.sleep(1.0)
        print(f"{n} probes each: /health worst {worst_health * 1000:.0f} ms, completion worst "
              f"{worst_completion * 1000:.0f} ms, {bad} missed (status != 200 or > 1 s)")
        ok &= bad == 0 and refused == 0

        # Concurrent streams, slow clients still attached.
        results = [None] * a.streams

        def one_stream(i):
            body = {"model": "x", "prompt": f"Tom had a ball {i}", "max_tokens": 32, "stream": True, "seed": i}
            try:
                st, out, _ = http(port, "POST", "/v1/completions", body, timeout=120)
                results[i] = st == 200 and b"data: [DONE]" in out
            except OSError:
                results[i] = False

        ts = [threading.Thread(target=one_stream, args=(i,)) for i in range(a.streams)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        done = sum(1 for r in results if r)
        th, rss = proc_stats(d.pid)
        peak_threads, peak_rss = max(peak_threads, th), max(peak_rss, rss)
        print(f"{a.streams} concurrent streams: {done} ended with [DONE] in {time.monotonic() - t0:.1f} s")
        ok &= done == a.streams
        print(f"peak: {peak_threads} threads, {peak_rss / 1024:.1f} MiB resident "
              f"(at rest {base_threads} threads, {base_rss / 1024:.1f} MiB)")
        stop.set()
        for s in slow:
            s.close()
    finally:
        d.terminate()
        try:
            d.wait(timeout=30)
        except subprocess.TimeoutExpired:
            d.kill()
        log.close()
    print("slowloris-bench:", "PASS" if ok else "FAIL: a target was missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
