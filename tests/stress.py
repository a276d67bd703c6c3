#!/usr/bin/env python3
"""Adversarial stress suite for prefixd: the real daemon (build/prefixd) and
build/prefixctl on loopback ports, real LMDB stores in temporary folders.

Sections (each prints one PASS/FAIL line; the exit status is 1 when any
fails):

  slowloris           ~300 half-sent requests dripping a byte a second for
                      ~10 s; /health and a 4-token completion each answer
                      within 1 s throughout, and the daemon serves after
  streams             32 concurrent streamed completions all end with
                      `data: [DONE]`
  aborts              ~100 streams closed by the client after the first chunk;
                      the daemon serves after, the scheduler's running/queued
                      gauges return to 0 and the requests count as cancelled
  malformed           a few hundred bad requests (broken JSON, wrong types,
                      huge numbers, deep nesting, invalid UTF-8, duplicate
                      keys, wrong methods, unknown routes, bad Content-Length
                      and Authorization, garbage request lines, many query
                      arguments): 4xx (2xx when valid) with an OpenAI-shaped
                      JSON error, never a crash
  sigkill_during_job  SIGKILL while an admin registration job runs; the store
                      verifies and the restarted daemon serves its prefixes
  store_faults        truncated and empty data.mdb: exit status > 0 naming
                      `salvage`; salvage of the truncated copy gives a store
                      the daemon starts on; flipped bytes in data pages never
                      kill the daemon or verify with a signal
  two_daemons         a prefix registered through daemon A is used through B,
                      deleted through A, then unknown (404) to B
  tenants             api_keys_file with two namespaces: A's prefix works with
                      key A; with key B its prefix_id answers exactly as a
                      made-up id

  tests/stress.py [--prefixd build/prefixd] [--prefixctl build/prefixctl]
                  [--model M.gguf] [--only NAME[,NAME]] [--keep]

Python 3 standard library only. The model is --model, else
$PD_SHARED_MODELS/tinystories/stories260K.gguf, else one written by
`prefixctl gen-model --preset stories260k`.
"""
import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "sunshine. One day, she saw a big tree with a red ball in it. She wanted the ball very much.")
ADMIN = "adm1n-str3ss"
UNKNOWN_ID = "0123456789abcdef" * 4


class CheckFailed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def short(b, n=300):
    if isinstance(b, bytes):
        b = b.decode("utf-8", "replace")
    b = b if len(b) <= n else b[:n] + f"... ({len(b)} chars)"
    return b.replace("\r", "\\r").replace("\n", "\\n")


# ---- HTTP over raw sockets ---------------------------------------------------


class Resp:
    def __init__(self, status, headers, body, raw, elapsed, complete):
        self.status, self.headers, self.body, self.raw = status, headers, body, raw
        self.elapsed, self.complete = elapsed, complete

    @property
    def ctype(self):
        return self.headers.get("content-type", "")

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    def __repr__(self):
        return f"<{self.status} {self.ctype} {short(self.body, 200)!r}>"


def dechunk(data):
    """The body of a chunked transfer; (body, complete)."""
    out, i = bytearray(), 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            return bytes(out), False
        try:
            n = int(data[i:j].split(b";")[0].strip() or b"x", 16)
        except ValueError:
            return bytes(out), False
        if n == 0:
            return bytes(out), True
        if j + 2 + n > len(data):
            out += data[j + 2:]
            return bytes(out), False
        out += data[j + 2:j + 2 + n]
        i = j + 2 + n + 2


def parse_response(raw, elapsed, head_only=False):
    """The first HTTP response in raw, or None when there is none."""
    if not raw.startswith(b"HTTP/1."):
        return None
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    try:
        status = int(parts[1])
    except (IndexError, ValueError):
        return None
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    complete = True
    if head_only or status in (204, 304):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body, complete = dechunk(rest)
    elif "content-length" in headers:
        n = int(headers["content-length"])
        body, complete = rest[:n], len(rest) >= n
    else:
        body = rest
    return Resp(status, headers, body, raw, elapsed, complete)


def exchange(port, data, timeout=30.0, head_only=False):
    """Send raw bytes and read until the peer closes (or timeout): (the
    parsed first response or None, the raw bytes, seconds)."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = bytearray()
    try:
        s.settimeout(timeout)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (413) and closed: read what it sent
        deadline = t0 + timeout
        while True:
            s.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
            if time.monotonic() > deadline:
                break
    finally:
        s.close()
    dt = time.monotonic() - t0
    return parse_response(bytes(out), dt, head_only), bytes(out), dt


def build_request(method, path, body=None, headers=None, ctype="application/json", auth=None):
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    h = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
    if auth is not None:
        h += b"Authorization: Bearer " + (auth.encode() if isinstance(auth, str) else auth) + b"\r\n"
    for k, v in (headers or {}).items():
        h += k.encode() + b": " + (v.encode() if isinstance(v, str) else v) + b"\r\n"
    if body is not None:
        if ctype:
            h += f"Content-Type: {ctype}\r\n".encode()
        h += f"Content-Length: {len(body)}\r\n".encode()
    return h + b"\r\n" + (body or b"")


def http(port, method, path, body=None, auth=None, timeout=30.0, headers=None):
    """One request on a fresh connection: a Resp (raises when there is no
    HTTP answer)."""
    r, raw, dt = exchange(port, build_request(method, path, body, headers, auth=auth), timeout,
                          head_only=method == "HEAD")
    if r is None:
        raise CheckFailed(f"{method} {path}: no HTTP answer after {dt:.1f} s: {short(raw)!r}")
    return r


def sse_events(body):
    """The data: payloads of an SSE body, in order."""
    text = body.decode("utf-8", "replace")
    return [ev[6:] for ev in text.split("\n\n") if ev.startswith("data: ")]


def check_stream(r, what):
    check(r.status == 200, f"{what}: status {r.status}: {short(r.body)}")
    check(r.ctype.startswith("text/event-stream"), f"{what}: content type {r.ctype!r}")
    check(r.complete, f"{what}: the chunked body was cut off: ...{short(r.body[-200:])}")
    evs = sse_events(r.body)
    check(evs and evs[-1] == "[DONE]", f"{what}: does not end with data: [DONE]: ...{short(r.body[-300:])}")
    for e in evs[:-1]:
        j = json.loads(e)
        check("error" not in j, f"{what}: an error event: {e}")
        check(isinstance(j.get("choices"), list), f"{what}: a chunk without choices: {e}")
    return evs


def metric(text, series):
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line[len(series) + 1:].split()[0])
    return None


# ---- daemons -------------------------------------------------------------------


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Daemon:
    """prefixd on a loopback port with its store in `store`; stderr goes to a
    log file in `work`."""

    count = 0

    def __init__(self, ctx, store, extra=(), name=None):
        Daemon.count += 1
        self.ctx, self.store, self.extra = ctx, store, list(extra)
        self.name = name or f"prefixd{Daemon.count}"
        self.log_path = os.path.join(ctx.work, f"{self.name}.log")
        self.proc, self.port, self._model_id = None, None, None

    def argv(self, port):
        a = [self.ctx.prefixd, "--set", f"model.path={self.ctx.model}", "--set", f"cache.path={self.store}",
             "--set", "cache.map_size_mb=64", "--set", "model.n_threads=2", "--set", f"server.port={port}"]
        for kv in self.extra:
            a += ["--set", kv]
        return a

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def spawn(self):
        """Start the process; returns without waiting for it."""
        self.port = free_port()
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(self.port), stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        logf.close()
        return self.proc

    def start(self, timeout=60.0):
        """Start and wait until /health is 200 (fails when it exits first).
        A port taken between free_port() and the bind is retried."""
        for attempt in range(3):
            mark = len(self.log())
            self.spawn()
            t_end = time.monotonic() + timeout
            while time.monotonic() < t_end:
                rc = self.proc.poll()
                if rc is not None:
                    text = self.log()[mark:]
                    if "in use" in text and attempt < 2:
                        break
                    raise CheckFailed(f"{self.name} exited with {rc} while starting:\n{text[-2000:]}")
                try:
                    r, _, _ = exchange(self.port, build_request("GET", "/health"), timeout=2)
                    if r and r.status == 200:
                        m = re.search(r"listening on \S+:(\d+)", self.log()[mark:])
                        check(m and int(m.group(1)) == self.port,
                              f"{self.name}: no 'listening on ...:{self.port}' line in its log")
                        return self
                except OSError:
                    pass
                time.sleep(0.05)
            else:
                self.kill()
                raise CheckFailed(f"{self.name} did not become healthy in {timeout:.0f} s:\n{self.log()[-2000:]}")
        raise CheckFailed(f"{self.name}: could not bind a port:\n{self.log()[-2000:]}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=30.0):
        """Send sig and wait; returns the returncode (None when not started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self):
        return self.stop(signal.SIGKILL, 10)

    def stop_clean(self, what=""):
        """SIGTERM: the daemon must exit 0 (under ASan this also catches leaks)."""
        rc = self.stop(signal.SIGTERM, 60)
        check(rc == 0, f"{self.name} {what}: SIGTERM ended it with returncode {rc}:\n{self.log()[-2000:]}")

    def model_id(self, auth=None):
        if self._model_id is None:
            r = http(self.port, "GET", "/v1/models", auth=auth)
            check(r.status == 200, f"GET /v1/models: {r}")
            self._model_id = r.json()["data"][0]["id"]
            check(isinstance(self._model_id, str) and self._model_id, f"model id {self._model_id!r}")
        return self._model_id

    def completion(self, prompt, max_tokens=4, auth=None, timeout=60.0, **kw):
        body = {"model": self.model_id(auth), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body.update(kw)
        return http(self.port, "POST", "/v1/completions", body, auth=auth, timeout=timeout)

    def metrics(self):
        r = http(self.port, "GET", "/metrics")
        check(r.status == 200, f"GET /metrics: {r}")
        return r.body.decode()

    def serves(self, what="", auth=None):
        """/health ok and a 4-token completion answered."""
        check(self.alive(), f"{self.name} {what}: the process is gone (returncode {self.proc.returncode}):\n"
              f"{self.log()[-2000:]}")
        r = http(self.port, "GET", "/health", timeout=10)
        check(r.status == 200 and r.json().get("status") == "ok", f"{self.name} {what}: /health: {r}")
        r = self.completion("The cat", 4, auth=auth)
        check(r.status == 200, f"{self.name} {what}: completion: {r}")
        check(r.json()["usage"]["completion_tokens"] >= 1, f"{self.name} {what}: completion: {r}")


class Ctx:
    def __init__(self, args, work):
        self.prefixd, self.prefixctl, self.model, self.work = args.prefixd, args.prefixctl, args.model, work
        self.daemons = []
        self.n = 0

    def daemon(self, store=None, extra=(), name=None):
        if store is None:
            store = self.tmp("store")
        d = Daemon(self, store, extra, name)
        self.daemons.append(d)
        return d

    def tmp(self, what):
        self.n += 1
        return os.path.join(self.work, f"{what}{self.n}")

    def ctl(self, *args, timeout=120):
        p = subprocess.run([self.prefixctl, *args], capture_output=True, timeout=timeout)
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")

    def kill_all(self):
        for d in self.daemons:
            d.kill()
        self.daemons = []


def register(d, text=STORY, namespace=None, wait=True, **kw):
    body = {"text": text, "policy": "knorm", "retention": 0.5, "wait": wait}
    if namespace is not None:
        body["namespace"] = namespace
    body.update(kw)
    body = {k: v for k, v in body.items() if v is not None}
    return http(d.port, "POST", "/admin/v1/prefixes", body, auth=ADMIN, timeout=120)


def register_id(d, text=STORY, namespace=None):
    r = register(d, text, namespace)
    check(r.status == 201, f"registering a prefix: {r}")
    j = r.json()
    check(j.get("state") == "done", f"registering a prefix: {r}")
    pid = j["prefix"]["id"]
    check(re.fullmatch(r"[0-9a-f]{64}", pid or ""), f"prefix id {pid!r}")
    return pid


def cached_tokens(r):
    """Prompt tokens a registered prefix covered: the checks here are about
    stored prefixes, so blocks of the automatic cache (earlier requests'
    exact KV, "kind": "auto") count as none."""
    j = r.json()
    if (j.get("prefix") or {}).get("kind", "registered") != "registered":
        return 0
    return j["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def error_of(r, what):
    """The error object of an OpenAI-shaped error reply (checked)."""
    check(r.ctype.startswith("application/json"), f"{what}: content type {r.ctype!r}: {r}")
    j = r.json()
    e = j.get("error") if isinstance(j, dict) else None
    check(isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str),
          f"{what}: not an OpenAI error: {short(r.body)}")
    return e


# ---- 1. slowloris --------------------------------------------------------------


def sec_slowloris(ctx):
    n_slow, n_body, hold, drip = 300, 50, 10.0, 1.0  # n_body of them drip a body, the rest headers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n_slow + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n_slow + 256, hard), hard))
    d = ctx.daemon(name="slowloris").start()
    mid = d.model_id()
    slow = []
    # Half-sent headers, and complete headers of a completion whose
    # declared body comes a byte at a time.
    partial = b"ET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    body_head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    body_drip = b'{"model":' + json.dumps(mid).encode() + b',"prompt":"' + b"a" * 1000
    try:
        for k in range(n_slow):
            s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
            s.sendall(body_head if k < n_body else b"G")
            slow.append((s, body_drip if k < n_body else partial))
        check(len(slow) == n_slow, f"opened {len(slow)} of {n_slow} slow connections")
        stop = threading.Event()
        sent = [0, 0]  # bytes dripped, send errors

        def dripper():
            i = 0
            while not stop.wait(drip):
                for s, what in slow:
                    try:
                        s.send(what[i:i + 1])
                        sent[0] += 1
                    except OSError:
                        sent[1] += 1
                i += 1

        t = threading.Thread(target=dripper, daemon=True)
        t.start()
        misses, probes = [], 0
        body = {"model": mid, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        t_end = time.monotonic() + hold
        while time.monotonic() < t_end:
            for what, req in (("health", build_request("GET", "/health")),
                              ("completion", build_request("POST", "/v1/completions", body))):
                try:
                    r, raw, dt = exchange(d.port, req, timeout=5)
                except OSError as e:
                    r, raw, dt = None, str(e).encode(), 5.0
                probes += 1
                if r is None or r.status != 200 or dt > 1.0:
                    misses.append(f"{what}: {r.status if r else short(raw)} in {dt * 1000:.0f} ms")
            time.sleep(0.5)
        stop.set()
        t.join()
        check(probes >= 10, f"only {probes} probes in {hold:.0f} s")
        check(not misses, f"{len(misses)} of {probes} probes missed (status != 200 or > 1 s): {misses[:5]}")
        check(sent[0] >= n_slow * 5, f"only {sent[0]} bytes dripped ({sent[1]} send errors)")
        d.serves("with the slow clients still attached")
    finally:
        for s, _ in slow:
            s.close()
    d.serves("after the slow clients left")
    d.stop_clean("after the slow clients")
    return (f"{n_slow} slow sockets ({n_body} dripping a body) for {hold:.0f} s, {probes} probes all < 1 s, "
            f"{sent[0]} bytes dripped")


# ---- 2. streams ----------------------------------------------------------------


def stream_body(mid, i, max_tokens=128, **kw):
    b = {"model": mid, "prompt": f"Tom had a ball {i}", "max_tokens": max_tokens, "stream": True, "seed": i}
    b.update(kw)
    return b


def sec_streams(ctx):
    n = 32
    d = ctx.daemon(name="streams").start()
    mid = d.model_id()
    results = [None] * n

    def one(i):
        try:
            r = http(d.port, "POST", "/v1/completions", stream_body(mid, i), timeout=120)
            evs = check_stream(r, f"stream {i}")
            last = json.loads(evs[-2])["choices"][0]
            check(last.get("finish_reason") in ("length", "stop"), f"stream {i}: last chunk {evs[-2]}")
            check(len(evs) >= 3, f"stream {i}: only {len(evs)} events")
            results[i] = ("ok", len(evs))
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = ("fail", str(e))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    bad = [f"{i}: {r}" for i, r in enumerate(results) if not r or r[0] != "ok"]
    check(not bad, f"{len(bad)} of {n} streams failed: {bad[:3]}")
    d.serves("after the streams")
    d.stop_clean("after the streams")
    return f"{n} concurrent streams ended with [DONE] in {time.monotonic() - t0:.1f} s"


# ---- 3. aborts -----------------------------------------------------------------


def sec_aborts(ctx):
    n, workers = 100, 10
    d = ctx.daemon(name="aborts").start()
    mid = d.model_id()
    m0 = d.metrics()
    cancelled0 = metric(m0, 'prefixd_requests_total{outcome="cancelled"}') or 0
    # Long streams (EOS banned): only the client's close ends them early.
    # EOS is token 2 in stories260K's (llama SentencePiece) vocabulary.
    errors, got_first = [], [0]
    lock = threading.Lock()

    def worker(w):
        for k in range(n // workers):
            i = w * (n // workers) + k
            req = build_request("POST", "/v1/completions",
                                stream_body(mid, i, max_tokens=400, logit_bias={"2": -100}))
            try:
                s = socket.create_connection(("127.0.0.1", d.port), timeout=60)
                s.settimeout(60)
                s.sendall(req)
                buf = b""
                while b"data: " not in buf:
                    c = s.recv(4096)
                    if not c:
                        break
                    buf += c
                s.close()
                with lock:
                    if b"data: " in buf and buf.startswith(b"HTTP/1.1 200"):
                        got_first[0] += 1
                    else:
                        errors.append(f"request {i}: no first chunk: {short(buf)!r}")
            except OSError as e:
                with lock:
                    errors.append(f"request {i}: {e}")

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    check(not errors, f"{len(errors)} aborted requests misbehaved: {errors[:3]}")
    check(got_first[0] == n, f"{got_first[0]} of {n} streams sent a first chunk")
    running = queued = None
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end:
        m = d.metrics()
        running, queued = metric(m, "prefixd_running_sequences"), metric(m, "prefixd_queue_depth")
        if running == 0 and queued == 0:
            break
        time.sleep(0.1)
    check(running == 0 and queued == 0,
          f"10 s after {n} aborted streams: prefixd_running_sequences {running}, prefixd_queue_depth {queued}")
    m = d.metrics()
    cancelled = (metric(m, 'prefixd_requests_total{outcome="cancelled"}') or 0) - cancelled0
    gen = metric(m, "prefixd_generated_tokens_total") or 0
    # A stream ends as soon as a write to its closed socket fails: not one
    # of them may have run its 400 tokens to the end.
    check(cancelled == n, f"{cancelled:.0f} of {n} aborted streams counted as cancelled")
    check(gen < n * 400 / 2, f"{gen:.0f} tokens generated for {n} streams closed after their first chunk")
    d.serves("after the aborts")
    d.stop_clean("after the aborts")
    return f"{n} streams aborted after their first chunk: all cancelled, {gen:.0f} tokens generated, gauges back to 0"


# ---- 4. malformed --------------------------------------------------------------

# Statuses libmicrohttpd answers itself (malformed request line or headers,
# pool overflow, HTTP version): its HTML body is accepted for these only.
MHD_STATUSES = {400, 413, 414, 431, 505}
KEY = "sk-str3ss"


class Case:
    def __init__(self, name, data, allow=None, silent_ok=False, head=False):
        self.name, self.data, self.head = name, data, head
        self.allow = allow  # None: any 4xx (or 2xx); else a set of statuses
        self.silent_ok = silent_ok  # a closed connection without an answer is acceptable


def malformed_cases(mid, rng):
    cases = []
    good = {"model": mid, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    good_text = json.dumps(good)

    def post(name, body, allow=None, path="/v1/completions", auth=KEY, headers=None, ctype="application/json"):
        cases.append(Case(name, build_request("POST", path, body, headers, ctype=ctype, auth=auth), allow))

    # Broken JSON: truncations and random byte damage of a valid body.
    for cut in sorted(rng.sample(range(1, len(good_text) - 1), 30)):
        post(f"truncated at {cut}", good_text[:cut], {400})
    for k in range(40):
        b = bytearray(good_text.encode())
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.choice(b'{}[]":,\\ \x00\x7fxe1-.')
        post(f"damaged {k}", bytes(b))  # may still be valid JSON: any 2xx/4xx
    for name, body in [("empty", ""), ("not json", "{not json"), ("null", "null"), ("array", "[1,2]"),
                       ("number", "123"), ("string", '"str"'), ("empty object", "{}"),
                       ("trailing garbage", good_text + "xyz"), ("two objects", good_text + good_text),
                       ("single quotes", good_text.replace('"', "'")), ("NaN", '{"model":"m","prompt":NaN}'),
                       ("comment", "/*x*/" + good_text), ("bom", "\ufeff" + good_text),
                       ("unterminated string", '{"model":"' + mid), ("lone backslash", '{"model":"\\"}')]:
        post(f"bad JSON: {name}", body, {400})
    chat = {"model": mid, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for name, body in [("no messages", {"model": mid}), ("messages not array", dict(chat, messages="hi")),
                       ("empty messages", dict(chat, messages=[])),
                       ("bad role", dict(chat, messages=[{"role": "wizard", "content": "x"}])),
                       ("content number", dict(chat, messages=[{"role": "user", "content": 5}])),
                       ("bad part", dict(chat, messages=[{"role": "user", "content": [{"type": "image"}]}])),
                       ("message not object", dict(chat, messages=["x"]))]:
        post(f"chat: {name}", body, {400}, path="/v1/chat/completions")

    # Wrong types and out-of-range values of every known field.
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "stop", "seed",
              "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "echo", "suffix", "stream",
              "stream_options", "user", "top_k", "min_p", "repetition_penalty", "prefix_id", "cache",
              "cache_salt"]
    values = [[], {}, "x", 1.5, -1, True, "", [[]], {"a": {"b": 1}}, 10 ** 30, -(10 ** 30)]
    for f in fields:
        for v in values:
            post(f"{f} = {json.dumps(v)[:20]}", dict(good, **{f: v}))
    # Clearly invalid values: exactly 400.
    for f, v in [("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2 ** 31), ("max_tokens", 2 ** 63),
                 ("max_tokens", 2 ** 64 + 5), ("max_tokens", 1e300), ("max_tokens", "4"), ("temperature", 2.5),
                 ("temperature", -0.1), ("temperature", 1e308), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 9),
                 ("n", 10 ** 6), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]), ("stop", "x" * 2000),
                 ("presence_penalty", 3), ("frequency_penalty", -2.5), ("logit_bias", {"99999999999": 1}),
                 ("logit_bias", {"-1": 5}), ("logit_bias", {"1": 1000}), ("logit_bias", {"abc": 1}),
                 ("logit_bias", {"1": "x"}), ("logit_bias", {str(i): 1 for i in range(1100)}),
                 ("logprobs", 6), ("logprobs", -1), ("echo", True), ("suffix", "x"), ("best_of", 3),
                 ("prompt", ["a", "b"]), ("prompt", [[1, 2], [3]]), ("prompt", [99999999]), ("prompt", [-5]),
                 ("prompt", "a\u0000b"), ("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0),
                 ("repetition_penalty", -1), ("prefix_id", "zz"), ("prefix_id", "g" * 64),
                 ("cache", "sometimes"), ("cache_salt", ""), ("cache_salt", "s" * 65),
                 ("stream_options", {"include_usage": "yes"}), ("seed", 2 ** 64), ("seed", 1.5),
                 ("seed", -(2 ** 63) - 1), ("prompt", "x " * 40000)]:
        post(f"invalid {f} = {json.dumps(v)[:24]}", dict(good, **{f: v}), {400})
    post("prefix_id with cache off", dict(good, prefix_id=UNKNOWN_ID, cache="off"), {400})
    post("unknown prefix_id", dict(good, prefix_id=UNKNOWN_ID), {404})
    # Raw numbers JSON parsers disagree on.
    for raw in ["1e400", "-1e400", "123456789012345678901234567890", "-0", "0.0000000000000000001e-400",
                "1E2", "00", "01", "+1", ".5", "1.", "0x10", "Infinity"]:
        post(f"raw number max_tokens={raw}", '{"model":%s,"prompt":"Hi","max_tokens":%s}' % (json.dumps(mid), raw))
    # The model name must be the served one (GET /v1/models).
    post("unknown model name", dict(good, model="no-such-model"), {404})
    post("missing model", {"prompt": "Hi", "max_tokens": 2}, {400})
    post("missing prompt", {"model": mid, "max_tokens": 2}, {400})

    # Deep nesting (the limit is 16 levels), also in ignored fields.
    for depth in [15, 17, 64, 1000, 100000]:
        post(f"nesting {depth} deep", '{"model":%s,"prompt":"Hi","max_tokens":2,"x":%s%s}' % (
            json.dumps(mid), "[" * depth, "]" * depth), {200} if depth + 1 <= 16 else {400})
    post("nested objects 40 deep", '{"model":%s,"prompt":"Hi","x":%s1%s}' % (
        json.dumps(mid), '{"a":' * 40, "}" * 40), {400})

    # Invalid UTF-8 and bad escapes, in values and keys.
    for name, bad in [("0xff", b"\xff"), ("overlong /", b"\xc0\xaf"), ("surrogate", b"\xed\xa0\x80"),
                      ("truncated", b"\xe2\x82"), ("5-byte", b"\xf8\x88\x80\x80\x80"),
                      ("above U+10FFFF", b"\xf4\x90\x80\x80"),
                      ("continuation", b"\x80\x80")]:
        post(f"invalid UTF-8 in prompt: {name}", b'{"model":' + json.dumps(mid).encode() + b',"prompt":"a' + bad +
             b'b","max_tokens":2}', {400})
        post(f"invalid UTF-8 in a key: {name}", b'{"model":' + json.dumps(mid).encode() + b',"p' + bad +
             b'":1,"prompt":"a","max_tokens":2}', {400})
    for name, esc in [("lone high surrogate", "\\ud800"), ("lone low surrogate", "\\udc00"), ("NUL", "\\u0000"),
                      ("bad escape", "\\q"), ("short escape", "\\u12")]:
        post(f"escape in prompt: {name}", '{"model":%s,"prompt":"a%sb","max_tokens":2}' % (json.dumps(mid), esc),
             {400})
    post("raw control character in a string", '{"model":%s,"prompt":"a\x01b","max_tokens":2}' % json.dumps(mid),
         {400})

    # Duplicate keys.
    for k, v in [("model", json.dumps(mid)), ("prompt", '"x"'), ("max_tokens", "2"), ("temperature", "0")]:
        post(f"duplicate key {k}", good_text[:-1] + f',"{k}":{v}' + "}", {400})
    post("duplicate key in logit_bias", good_text[:-1] + ',"logit_bias":{"5":1,"5":2}}', {400})

    # Wrong methods and unknown routes.
    for m in ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO", "get", "PROPFIND"]:
        for path in ["/v1/completions", "/health", "/v1/models"]:
            cases.append(Case(f"{m} {path}", build_request(m, path, good if m != "TRACE" else None, auth=KEY),
                              {405, 400, 501}))
    cases.append(Case("HEAD /health", build_request("HEAD", "/health"), {405, 200}, head=True))
    for path in ["/", "/v1", "/v1/", "/v1/completion", "/v1/completions/", "//v1/completions", "/V1/COMPLETIONS",
                 "/v1/completions%00", "/v1/completions/../models", "/v1/chat", "/v1/embeddings", "/%ff%fe",
                 "/admin", "/admin/v1/nothing", "/admin/v1/prefixes/zz", "/admin/v1/jobs/-1",
                 "/admin/v1/jobs/99999999999999999999999", "/metrics/x", "/metrics%00x", "/health%00junk",
                 "/v1/models%00", "/" + "a" * 5000]:
        post(f"POST {path[:40]}", good, {404, 400, 414, 401, 405}, path=path)
        cases.append(Case(f"GET {path[:40]}", build_request("GET", path, auth=KEY), {404, 400, 414, 401, 405}))
    # Admin API with bad bodies (the admin token is configured).
    for name, body in [("broken", "{x"), ("text number", '{"text":42}'), ("empty", "{}"),
                       # the admin API has no 16-level limit of its own: jansson's (2048) refuses this
                       ("deep", '{"text":"a","x":' + "[" * 5000 + "]" * 5000 + "}"),
                       ("invalid UTF-8", b'{"text":"\xff\xfe"}'), ("retention 7", '{"text":"Hi","retention":7}'),
                       ("bad policy", '{"text":"Hi","policy":"nope:x=1"}'), ("both", '{"text":"a","segments":[]}'),
                       ("namespace too long", json.dumps({"text": "Hi", "namespace": "n" * 200})),
                       ("bad segment", '{"segments":[{"name":"a b","text":"x"}]}')]:
        post(f"admin: {name}", body, {400}, path="/admin/v1/prefixes", auth=ADMIN)
    post("admin without token", {"text": "Hi"}, {401}, path="/admin/v1/prefixes", auth=None)
    post("admin with the API key", {"text": "Hi"}, {401}, path="/admin/v1/prefixes", auth=KEY)

    # Content-Length and content type.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + \
        b"\r\nConnection: close\r\nContent-Type: application/json\r\n"
    body = good_text.encode()
    for name, cl, allow in [("10 GB", b"10000000000", {413}), ("2^64", b"18446744073709551616", {413, 400}),
                            ("10^30", b"1" + b"0" * 30, {413, 400}), ("-1", b"-1", {400, 413}),
                            ("abc", b"abc", {400}), ("1, 2", b"1, 2", {400}),
                            ("over the limit by one", str(1024 * 1024 + 1).encode(), {413})]:
        cases.append(Case(f"Content-Length {name}", head + b"Content-Length: " + cl + b"\r\n\r\n" + body, allow))
    cases.append(Case("two Content-Lengths", head + b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(body) +
                      body, None))
    cases.append(Case("Content-Length and chunked", head + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n", None))
    cases.append(Case("chunked body", head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body +
                      b"\r\n0\r\n\r\n", {200}))
    cases.append(Case("bad chunk size", head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", {400}))
    cases.append(Case("body over max_body_bytes (chunked)", head + b"Transfer-Encoding: chunked\r\n\r\n" +
                      b"".join(b"%x\r\n" % 65536 + b" " * 65536 + b"\r\n" for _ in range(18)) + b"0\r\n\r\n", {413}))
    for ct in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]:
        post(f"content type {ct!r}", good, None, ctype=ct)

    # Authorization.
    for name, val in [("none", None), ("wrong key", b"Bearer nope"), ("Bearer only", b"Bearer"),
                      ("Bearer space", b"Bearer "), ("two spaces", b"Bearer  " + KEY.encode()),
                      ("lower-case scheme", b"bearer " + KEY.encode()), ("Basic", b"Basic c2s6eA=="),
                      ("key prefix", b"Bearer " + KEY[:-1].encode()), ("key plus", b"Bearer " + KEY.encode() + b"x"),
                      ("8 KB token", b"Bearer " + b"k" * 8192), ("non-ASCII", b"Bearer \xff\xfe\x80"),
                      ("admin token", b"Bearer " + ADMIN.encode()), ("NUL inside", b"Bearer sk\x00str3ss")]:
        hdr = {} if val is None else {"Authorization": val}
        cases.append(Case(f"auth: {name}", build_request("POST", "/v1/completions", good, hdr), {401, 400}))
    cases.append(Case("auth: two headers", build_request("POST", "/v1/completions", good,
                                                           {"Authorization": b"Bearer nope"}, auth=KEY),
                      {401, 200}))

    # Garbage request lines and headers (libmicrohttpd answers many of these).
    for name, raw in [("junk", b"GARBAGE\r\n\r\n"), ("method only", b"GET\r\n\r\n"),
                      ("no version", b"GET /health\r\n\r\n"), ("HTTP/9.9", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
                      ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n"),
                      ("no Host", b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"),
                      ("binary", bytes(rng.randrange(256) for _ in range(300)) + b"\r\n\r\n"),
                      ("only CRLFs", b"\r\n" * 50), ("header without colon",
                                                     b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n"),
                      ("space before colon", b"GET /health HTTP/1.1\r\nHost : x\r\nConnection: close\r\n\r\n"),
                      ("NUL in header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\nConnection: close\r\n\r\n"),
                      ("bare LF", b"GET /health HTTP/1.1\nHost: x\nConnection: close\n\n"),
                      ("folded header",
                       b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\nConnection: close\r\n\r\n"),
                      ("300 KB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300000 + b"\r\n\r\n"),
                      ("300 KB URL", b"GET /health?" + b"a" * 300000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
                      ("5000 headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" +
                       b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"Connection: close\r\n\r\n"),
                      ("absolute URI", b"GET http://127.0.0.1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
                      ("asterisk", b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
                      ("pipelined junk", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nJUNK JUNK\r\n\r\n")]:
        cases.append(Case(f"raw: {name}", raw, {200, 400, 404, 405, 413, 414, 431, 505, 501}, silent_ok=True))

    # Many query arguments.
    for n in [100, 600, 3000]:
        q = "&".join(f"a{i}=1" for i in range(n))
        cases.append(Case(f"{n} query args on /health", build_request("GET", "/health?" + q), {200, 414, 431}))
        post(f"{n} query args on a completion", good, {200, 414, 431}, path="/v1/completions?" + q)
    cases.append(Case("repeated query arg", build_request("GET", "/health?" + "&".join(["x=1"] * 500)), {200}))
    cases.append(Case("odd query", build_request("GET", "/health?&&==&%zz&a=%ff"), {200, 400}))
    cases.append(Case("admin namespace arg", build_request("GET", "/admin/v1/prefixes?namespace=%ff%00x", auth=ADMIN),
                      {200, 400}))
    return cases


def judge(case, r, raw, dt):
    """Why the reply to case is wrong, or None."""
    if r is None:
        if case.silent_ok:
            return None
        return f"no HTTP answer after {dt:.1f} s: {short(raw, 120)!r}"
    st = r.status
    if case.allow is not None and st not in case.allow:
        return f"status {st}, expected {sorted(case.allow)}: {short(r.body, 200)}"
    if not (200 <= st < 300 or 400 <= st < 500 or st in MHD_STATUSES):
        return f"status {st}: {short(r.body, 200)}"
    if case.head or st == 204:
        return None
    ct = r.ctype.split(";")[0].strip().lower()
    if ct == "application/json":
        try:
            j = json.loads(r.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            return f"status {st}: a JSON content type with a body that does not parse ({e}): {short(r.body, 200)}"
        if st >= 400:
            e = j.get("error") if isinstance(j, dict) else None
            if not (isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str)):
                return f"status {st}: not an OpenAI error: {short(r.body, 200)}"
        return None
    if ct == "text/event-stream" and st == 200:
        evs = sse_events(r.body)
        if not evs or evs[-1] != "[DONE]":
            return f"a stream that does not end with [DONE]: ...{short(r.body[-200:])}"
        return None
    if ct.startswith("text/plain") and st == 200:
        return None  # /metrics
    # libmicrohttpd's own protocol errors keep its HTML body (docs/api.md);
    # anything prefixd answers is JSON.
    if st in MHD_STATUSES:
        return None
    return f"status {st} with content type {r.ctype!r} (not JSON): {short(r.body, 200)}"


def sec_malformed(ctx):
    d = ctx.daemon(name="malformed", extra=[f"server.api_key={KEY}", f"admin.token={ADMIN}",
                                            "server.max_body_bytes=1048576", "server.idle_timeout_s=2",
                                            "model.n_ctx=256"]).start()
    mid = d.model_id(auth=KEY)
    rng = random.Random(20240601)
    cases = malformed_cases(mid, rng)
    failures, statuses, silent, lock = [], {}, [], threading.Lock()
    idx = [0]

    def worker():
        while True:
            with lock:
                if idx[0] >= len(cases):
                    return
                c = cases[idx[0]]
                idx[0] += 1
            try:
                r, raw, dt = exchange(d.port, c.data, timeout=20, head_only=c.head)
                why = judge(c, r, raw, dt)
            except OSError as e:
                r, why = None, (None if c.silent_ok else f"socket error: {e}")
            with lock:
                key = r.status if r else "none"
                statuses[key] = statuses.get(key, 0) + 1
                if r is None:
                    silent.append(c.name)
                if why:
                    failures.append(f"{c.name}: {why}")

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(240)
    check(not any(t.is_alive() for t in ts), "the malformed requests did not finish in 240 s")
    check(d.alive(), f"the daemon died (returncode {d.proc.returncode}):\n{d.log()[-2000:]}")
    mix = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0])))
    mix += f"; closed without an answer: {', '.join(sorted(silent)) or 'none'}"
    d.serves("after the malformed requests", auth=KEY)
    d.stop_clean("after the malformed requests")
    check(not failures, f"{len(failures)} of {len(cases)} replies were wrong (statuses {mix}):\n    " +
          "\n    ".join(failures[:25]))
    return f"{len(cases)} requests ({mix}); the daemon still serves"


# ---- 5. SIGKILL during a job ---------------------------------------------------


def long_text(i, words=300):
    rng = random.Random(i)
    w = ["the", "little", "dog", "ran", "to", "a", "big", "tree", "and", "Lily", "saw", "ball", "red", "happy",
         "sun", "play", "friend", "went", "home", "mom", "said", "was", "very", "day"]
    return " ".join(rng.choice(w) for _ in range(words)) + "."


def sec_sigkill_during_job(ctx):
    store = ctx.tmp("store")
    extra = [f"admin.token={ADMIN}", "compression.min_prefix_tokens=8"]
    d = ctx.daemon(store, extra, name="job-a").start()
    done_id = register_id(d, STORY)  # one finished before the kill: must survive it
    # Several asynchronous jobs (calibrated: the slowest kind) queue behind
    # each other; kill as soon as one is seen running.
    jobs = []
    for i in range(10):
        r = register(d, long_text(i), wait=False, retention=None, quality=1.05, policy="knorm")
        check(r.status == 202, f"async registration {i}: {r}")
        jobs.append(r.json()["status_url"])
    seen, t_end = None, time.monotonic() + 60
    while time.monotonic() < t_end and seen is None:
        for url in jobs:
            r = http(d.port, "GET", url, auth=ADMIN)
            check(r.status == 200, f"GET {url}: {r}")
            j = r.json()
            check(j["state"] != "failed", f"job {url} failed: {j.get('error')}")
            if j["state"] == "running":
                seen = (url, j["phase"], j.get("progress"))
                break
    check(seen is not None, "no job was seen running (all finished before the first poll?)")
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    check(d.proc.returncode == -signal.SIGKILL, f"returncode {d.proc.returncode}")
    rc, out, err = ctx.ctl("store", "--dir", store, "verify")
    check(rc == 0, f"prefixctl store verify after the kill: exit {rc}:\n{out}{err}")
    d2 = ctx.daemon(store, extra, name="job-b").start()
    d2.serves("restarted on the store")
    r = http(d2.port, "GET", "/admin/v1/prefixes", auth=ADMIN)
    check(r.status == 200, f"listing after the restart: {r}")
    ids = [p["id"] for p in r.json()["data"]]
    check(done_id in ids, f"the prefix finished before the kill is gone: {ids}")
    for pid in ids:
        r = http(d2.port, "GET", f"/admin/v1/prefixes/{pid}", auth=ADMIN)
        check(r.status == 200 and "error" not in r.json(), f"prefix {pid} after the restart: {r}")
    r = http(d2.port, "GET", seen[0], auth=ADMIN)
    check(r.status == 404, f"{seen[0]} after the restart (jobs are not persisted): {r}")
    r = d2.completion(STORY + " Then", 4, prefix_id=done_id)
    check(r.status == 200 and cached_tokens(r) > 30, f"using the surviving prefix: {r}")
    # A job submitted again after the restart completes.
    r = register(d2, long_text(0))
    check(r.status == 201, f"registering again after the restart: {r}")
    d2.stop_clean()
    rc, out, err = ctx.ctl("store", "--dir", store, "verify")
    check(rc == 0, f"verify after the restart: exit {rc}:\n{out}{err}")
    return (f"killed while {seen[0]} was {seen[1]}; verify ok, {len(ids)} prefixes whole after the restart "
            f"(of {1 + len(jobs)} submitted)")


# ---- 6. store faults -----------------------------------------------------------


def make_store(ctx, n_prefixes=6):
    store = ctx.tmp("store")
    d = ctx.daemon(store, [f"admin.token={ADMIN}", "compression.min_prefix_tokens=8"], name="store-src").start()
    texts = [STORY] + [long_text(100 + i, 120) for i in range(n_prefixes - 1)]
    ids = {register_id(d, t): t for t in texts}
    check(len(ids) == n_prefixes, f"{len(ids)} distinct ids for {n_prefixes} texts")
    rc = d.stop()
    check(rc == 0, f"SIGTERM: exit {rc}")
    return store, ids


def uses_every_prefix(d, ids, listed, what):
    """Each listed prefix serves a completion through its prefix_id."""
    for p in listed:
        check(p["id"] in ids, f"{what}: a prefix nobody stored: {p['id']}")
        r = d.completion(ids[p["id"]] + " Then", 2, prefix_id=p["id"])
        check(r.status == 200 and cached_tokens(r) == p["tokens"], f"{what}: using {p['id']}: {r}")


def copy_store(ctx, src, what):
    dst = ctx.tmp(what)
    shutil.copytree(src, dst)
    return dst


def start_fails(ctx, store, what):
    """Start the daemon on a damaged store: it must exit > 0 naming salvage."""
    d = ctx.daemon(store, name=what)
    d.spawn()
    try:
        d.proc.wait(90)
    except subprocess.TimeoutExpired:
        d.kill()
        raise CheckFailed(f"{what}: the daemon started on the damaged store:\n{d.log()[-1500:]}")
    rc, log = d.proc.returncode, d.log()
    check(rc > 0, f"{what}: returncode {rc} (expected an exit status > 0, not a signal):\n{log[-1500:]}")
    check("salvage" in log, f"{what}: stderr does not name salvage:\n{log[-1500:]}")
    return rc


def sec_store_faults(ctx):
    store, ids = make_store(ctx)
    data = os.path.join(store, "data.mdb")
    size = os.path.getsize(data)
    rc, out, err = ctx.ctl("store", "--dir", store, "verify")
    check(rc == 0, f"verify of the intact store: {rc}:\n{out}{err}")
    notes = []

    # Truncated to half.
    trunc = copy_store(ctx, store, "truncated")
    os.truncate(os.path.join(trunc, "data.mdb"), size // 2)
    notes.append(f"half: exit {start_fails(ctx, trunc, 'truncated')}")
    rc, out, err = ctx.ctl("store", "--dir", trunc, "verify")
    check(rc > 0, f"verify of the truncated store: exit {rc}:\n{out}{err}")
    salvaged = ctx.tmp("salvaged")
    rc, out, err = ctx.ctl("store", "--dir", trunc, "salvage", salvaged)
    # 0: everything copied; 1: some records lay past the cut (dropped).
    check(rc in (0, 1) and re.search(r"salvaged \d+ of \d+", out),
          f"salvage of the truncated copy: exit {rc}:\n{out}{err}")
    copied = int(re.search(r"salvaged (\d+) of", out).group(1))
    rc2, out2, err2 = ctx.ctl("store", "--dir", salvaged, "verify")
    check(rc2 == 0, f"verify of the salvaged store: exit {rc2}:\n{out2}{err2}")
    d = ctx.daemon(salvaged, [f"admin.token={ADMIN}", "compression.min_prefix_tokens=8"], name="salvaged").start()
    d.serves("on the salvaged store")
    r = http(d.port, "GET", "/admin/v1/prefixes", auth=ADMIN)
    check(r.status == 200 and len(r.json()["data"]) == copied,
          f"the salvaged store lists {short(r.body)} (salvage said {copied})")
    uses_every_prefix(d, ids, r.json()["data"], "the salvaged store")
    d.stop_clean("on the salvaged store")
    notes.append(f"salvage kept {copied} of {len(ids)} (exit {rc})")
    # Salvage of the intact store keeps everything (exit 0).
    whole = ctx.tmp("salvaged-whole")
    rc, out, err = ctx.ctl("store", "--dir", store, "salvage", whole)
    check(rc == 0 and f"salvaged {len(ids)} of {len(ids)}" in out,
          f"salvage of the intact store: exit {rc}:\n{out}{err}")
    d = ctx.daemon(whole, [f"admin.token={ADMIN}", "compression.min_prefix_tokens=8"], name="salvaged-whole").start()
    r = http(d.port, "GET", "/admin/v1/prefixes", auth=ADMIN)
    check(r.status == 200 and len(r.json()["data"]) == len(ids), f"the store salvaged whole lists {short(r.body)}")
    uses_every_prefix(d, ids, r.json()["data"], "the store salvaged whole")
    d.stop_clean("on the store salvaged whole")

    # Zero bytes.
    empty = copy_store(ctx, store, "empty")
    os.truncate(os.path.join(empty, "data.mdb"), 0)
    notes.append(f"empty: exit {start_fails(ctx, empty, 'empty')}")

    # Flipped bytes in the middle of data pages: a clean refusal, a clean
    # start or a verify failure, never a signal.
    page = 4096
    n_pages = size // page
    rng = random.Random(7)
    outcomes = []
    for k, where in enumerate([n_pages // 2, n_pages // 3, 2 * n_pages // 3, n_pages - 2, 2, 3]):
        flipped = copy_store(ctx, store, "flipped")
        with open(os.path.join(flipped, "data.mdb"), "r+b") as f:
            off = where * page + page // 2 - 32
            f.seek(off)
            chunk = bytearray(f.read(64))
            for i in range(len(chunk)):
                chunk[i] ^= rng.choice([0x01, 0x80, 0xff, 0x10])
            f.seek(off)
            f.write(chunk)
        rc, out, err = ctx.ctl("store", "--dir", flipped, "verify")
        check(rc in (0, 1), f"verify with flipped bytes at page {where}: exit {rc} (negative: a signal):\n{out}{err}")
        d = ctx.daemon(flipped, [f"admin.token={ADMIN}", "compression.min_prefix_tokens=8"], name=f"flipped{k}")
        d.spawn()
        state = None
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            if d.proc.poll() is not None:
                break
            try:
                r, _, _ = exchange(d.port, build_request("GET", "/health"), timeout=2)
                if r and r.status == 200:
                    state = "serving"
                    break
            except OSError:
                pass
            time.sleep(0.05)
        if state == "serving":
            # Touch every prefix: list, show, and completions that look them up.
            # Every answer is a success or an OpenAI-shaped error (a record
            # that fails its checksums is an error, never served).
            answers = [http(d.port, "GET", "/admin/v1/prefixes", auth=ADMIN)]
            for pid, text in ids.items():
                answers.append(http(d.port, "GET", f"/admin/v1/prefixes/{pid}", auth=ADMIN))
                answers.append(d.completion(text + " Then", 2, prefix_id=pid))
                answers.append(d.completion(text + " Then", 2))
            for r in answers:
                if r.status != 200:
                    error_of(r, f"flipped bytes at page {where}")
            state = "served " + "/".join(f"{st}x{n}" for st, n in sorted(
                {st: sum(1 for r in answers if r.status == st) for st in {r.status for r in answers}}.items()))
            check(d.alive(), f"flipped bytes at page {where}: the daemon died serving "
                  f"(returncode {d.proc.returncode}):\n{d.log()[-1500:]}")
            d.stop()
            check(d.proc.returncode == 0, f"flipped bytes at page {where}: SIGTERM exit {d.proc.returncode}")
        else:
            if d.proc.poll() is None:
                d.kill()
                raise CheckFailed(f"flipped bytes at page {where}: neither served nor exited in 60 s")
            check(d.proc.returncode > 0, f"flipped bytes at page {where}: the daemon ended with returncode "
                  f"{d.proc.returncode} (a signal):\n{d.log()[-1500:]}")
            state = f"exit {d.proc.returncode}"
        outcomes.append(f"p{where}: verify {rc}, {state}")
    notes.append("flips: " + "; ".join(outcomes))
    return ", ".join(notes)


# ---- 7. two daemons on one store ---------------------------------------------


def sec_two_daemons(ctx):
    store = ctx.tmp("store")
    extra = [f"admin.token={ADMIN}", "compression.min_prefix_tokens=8"]
    a = ctx.daemon(store, extra, name="two-a").start()
    b = ctx.daemon(store, ["compression.min_prefix_tokens=8"], name="two-b").start()
    prompt = STORY + " Then"
    r = b.completion(prompt, 4)
    check(r.status == 200 and cached_tokens(r) == 0, f"B before the registration: {r}")
    pid = register_id(a, STORY)
    r = b.completion(prompt, 4, prefix_id=pid)
    check(r.status == 200 and cached_tokens(r) > 30, f"B using A's prefix by prefix_id: {r}")
    r = b.completion(prompt, 4)
    check(r.status == 200 and cached_tokens(r) > 30, f"B finding A's prefix by lookup: {r}")
    check(r.json().get("prefix", {}).get("id") == pid, f"B's lookup found another prefix: {r}")
    r = http(a.port, "DELETE", f"/admin/v1/prefixes/{pid}", auth=ADMIN)
    check(r.status == 204, f"DELETE through A: {r}")
    r = b.completion(prompt, 4, prefix_id=pid)
    check(r.status == 404, f"B after A deleted the prefix (prefix_id): expected 404, got {r}")
    e = error_of(r, "B's 404")
    r2 = b.completion(prompt, 4, prefix_id=UNKNOWN_ID)
    check(r2.status == 404, f"B with a made-up prefix_id: {r2}")
    check(error_of(r2, "made-up id")["type"] == e["type"], f"{r} vs {r2}")
    r = b.completion(prompt, 4)
    check(r.status == 200 and cached_tokens(r) == 0, f"B's lookup after the delete still finds it: {r}")
    r = a.completion(prompt, 4, prefix_id=pid)
    check(r.status == 404, f"A after its own delete: {r}")
    a.serves()
    b.serves()
    b.stop_clean()
    a.stop_clean()
    return "registered through A, used through B (prefix_id and lookup), deleted through A, then 404 in B"


# ---- 8. tenants ----------------------------------------------------------------


def sec_tenants(ctx):
    keys = os.path.join(ctx.work, "api-keys")
    with open(keys, "w") as f:
        f.write("# key      namespace\nkey-tenant-a ns-a\nkey-tenant-b ns-b\n")
    os.chmod(keys, 0o600)
    d = ctx.daemon(None, [f"server.api_keys_file={keys}", f"admin.token={ADMIN}",
                          "compression.min_prefix_tokens=8"], name="tenants").start()
    KA, KB = "key-tenant-a", "key-tenant-b"
    r = http(d.port, "GET", "/v1/models")
    check(r.status == 401, f"/v1/models without a key: {r}")
    pid = register_id(d, STORY, namespace="ns-a")
    prompt = STORY + " Then"
    r = d.completion(prompt, 4, auth=KA, prefix_id=pid)
    check(r.status == 200 and cached_tokens(r) > 30, f"key A with its prefix_id: {r}")
    r = d.completion(prompt, 4, auth=KA)
    check(r.status == 200 and cached_tokens(r) > 30, f"key A by lookup: {r}")
    r = d.completion(prompt, 4, auth=KB)
    check(r.status == 200 and cached_tokens(r) == 0, f"key B sees A's prefix by lookup: {r}")
    for p in (prompt, "A different prompt"):
        ra = d.completion(p, 4, auth=KB, prefix_id=pid)
        ru = d.completion(p, 4, auth=KB, prefix_id=UNKNOWN_ID)
        check(ra.status == ru.status == 404, f"key B: A's id {ra.status}, a made-up id {ru.status}")
        ba = ra.body.replace(pid.encode(), b"<ID>")
        bu = ru.body.replace(UNKNOWN_ID.encode(), b"<ID>")
        check(ba == bu, f"key B: A's prefix_id answers differently from a made-up id:\n  {short(ba)}\n  {short(bu)}")
        error_of(ra, "key B, A's id")
    r = d.completion(prompt, 4, auth="key-tenant-c")
    check(r.status == 401, f"an unknown key: {r}")
    d.serves(auth=KB)
    d.stop_clean()
    return "A's prefix works with key A (prefix_id and lookup); with key B it answers exactly as a made-up id"


# ---- driver --------------------------------------------------------------------

SECTIONS = [("slowloris", sec_slowloris), ("streams", sec_streams), ("aborts", sec_aborts),
            ("malformed", sec_malformed), ("sigkill_during_job", sec_sigkill_during_job),
            ("store_faults", sec_store_faults), ("two_daemons", sec_two_daemons), ("tenants", sec_tenants)]


def find_model(args, work):
    if args.model:
        return args.model
    shared = os.environ.get("PD_SHARED_MODELS") or os.path.join(ROOT, "..", "shared", "models")
    p = os.path.join(shared, "tinystories", "stories260K.gguf")
    if os.path.isfile(p):
        return p
    out = os.path.join(work, "model.gguf")
    subprocess.run([args.prefixctl, "gen-model", "--preset", "stories260k", "-q", "-o", out], check=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixd", default=os.environ.get("PD_PREFIXD", os.path.join(ROOT, "build", "prefixd")))
    ap.add_argument("--prefixctl",
                    default=os.environ.get("PD_PREFIXCTL", os.path.join(ROOT, "build", "tools", "prefixctl")))
    ap.add_argument("--model", help="GGUF model (default: stories260K from ../shared, else a generated one)")
    ap.add_argument("--only", action="append", default=[], help="run only these sections (comma-separated)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, stores)")
    args = ap.parse_args()
    only = {s for o in args.only for s in o.split(",") if s}
    names = [n for n, _ in SECTIONS]
    unknown = only - set(names)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(names)}")
    for exe in (args.prefixd, args.prefixctl):
        if not os.access(exe, os.X_OK):
            ap.error(f"{exe} is not an executable (build first, or pass --prefixd/--prefixctl)")
    work = tempfile.mkdtemp(prefix="prefixd-stress-", dir=os.environ.get("TMPDIR") or None)
    t_all = time.monotonic()
    failed = []
    try:
        args.model = find_model(args, work)
        print(f"stress: model {args.model}, work folder {work}", flush=True)
        for name, fn in SECTIONS:
            if only and name not in only:
                continue
            os.mkdir(os.path.join(work, name))
            ctx = Ctx(args, os.path.join(work, name))
            t0 = time.monotonic()
            try:
                summary = fn(ctx)
                print(f"PASS {name} ({time.monotonic() - t0:.1f} s): {summary}", flush=True)
            except Exception as e:  # noqa: BLE001 - a failed section, reported
                failed.append(name)
                detail = str(e) if isinstance(e, CheckFailed) else traceback.format_exc()
                print(f"FAIL {name} ({time.monotonic() - t0:.1f} s): {detail}", flush=True)
                for d in ctx.daemons:
                    if d.proc is not None:
                        print(f"  --- {d.name} log (returncode {d.proc.poll()}), last lines:\n"
                              + "\n".join("  " + ln for ln in d.log().splitlines()[-15:]), flush=True)
            finally:
                ctx.kill_all()
    finally:
        if args.keep or failed:
            print(f"stress: work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"stress: {'FAIL: ' + ', '.join(failed) if failed else 'all passed'} "
          f"in {time.monotonic() - t_all:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
