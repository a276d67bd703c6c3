#!/usr/bin/env python3
"""The operator console (/admin/ui/) in a real headless Chromium against the
real daemon.

Starts build/prefixd on two loopback ports (the public API and the admin
listener on its own port, admin.token set) with the real stories260K model
and a store in a temporary folder, then drives the console like an
operator, over the DevTools protocol (cdp.py): a wrong token is refused and
the right one logs in; a text prefix is registered (knorm, retention 0.5)
while the job's progress is watched; its row, detail page (quality table,
heat strip of kept fraction per layer and kv head) are checked; a second
prefix is registered with a quality budget, so it has a calibration curve,
drawn as a chart; the playground streams a completion that starts with the
first prefix's text and shows its cached tokens and prefix; the traffic
tiles fill in; the first prefix is deleted through the confirmation dialog
(cancelled once) and the admin API no longer has it. Throughout: no
JavaScript error, no alert/confirm, the token only in sessionStorage and
never in a URL. Screenshots of each page go to $PREFIXD_SCREENSHOTS (default
a temporary folder).

Environment: PD_PREFIXD (the daemon; default build/prefixd), PD_SHARED_MODELS
(../shared/models), PD_SANITIZE (meson's b_sanitize: an ASan daemon is
slower, timeouts are scaled by 3), PD_BROWSER_TIMEOUT_SCALE (overrides that
scale), PREFIXD_SCREENSHOTS, CI.

Exit status: 0 passed, 1 failed, 77 skipped (meson's code) when chromium or
python3-websocket is missing -- except with CI=true, where that fails: CI
must really run it.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SKIP = 77
IN_CI = os.environ.get("CI", "").lower() == "true"
INSTALL_HINT = "install them with deploy/install-deps.sh (Debian packages chromium and python3-websocket)"


def missing_dependency(what):
    if IN_CI:
        print(f"FAIL: {what}; CI=true, so the browser test must run: {INSTALL_HINT}", flush=True)
        sys.exit(1)
    print(f"SKIP: {what}; {INSTALL_HINT}", flush=True)
    sys.exit(SKIP)


try:
    import websocket  # noqa: F401
except ImportError:
    # Debian's python3-websocket lives in the system interpreter's
    # dist-packages; a python3 from elsewhere on PATH (pyenv, a venv) does
    # not see it. The module is pure Python: use it from there.
    sys.path.append("/usr/lib/python3/dist-packages")
    try:
        import websocket  # noqa: F401
    except ImportError:
        missing_dependency("python3-websocket (websocket-client) is not importable")

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, HERE)
import cdp  # noqa: E402

TOKEN = "console-test-admin-token-7f3a"
WRONG_TOKEN = "not-the-admin-token"
MODEL_N_LAYER, MODEL_N_HEAD_KV = 5, 4  # stories260K (models/MANIFEST.md)
# Two stories of a few hundred tokens each (stories260K's tokenizer has 512
# pieces, about 3-4 characters a token). Each ends with a full stop, so a
# prompt that continues with " Then" starts with the prefix's tokens.
STORY_A = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine "
    "with her dog Max. One day, she saw a big tree with a red ball in it. She wanted the ball very "
    "much, but the tree was too tall. Lily asked her mom for help. Her mom said, \"Let's get a long "
    "stick.\" They found a stick near the pond and came back to the tree. Mom reached up high and "
    "pushed the ball. The ball fell down and bounced on the grass. Max ran after it and barked happily. "
    "Lily laughed and hugged her mom. They played with the ball all day until the sun went down. "
    "At night, Lily was tired but happy. She put the red ball next to her bed and smiled. "
    "She knew that tomorrow would be another fun day with Max and her mom in the big green park.")
STORY_B = (
    "Tom was a small boy who lived in a house near the sea. Every morning he went to the beach with "
    "his friend Sue. They liked to build sand castles and look for shells. One day, they found a "
    "little crab under a rock. The crab was scared and tried to hide. Tom said, \"Do not be afraid, "
    "little crab. We want to be your friends.\" Sue gave the crab a piece of bread. The crab came out "
    "slowly and ate the bread. Tom and Sue were very happy. They named the crab Pinch. Every day after "
    "that, Pinch waited for them by the rock. The three friends played together in the warm sand, and "
    "when the waves came, they ran and laughed. Tom's dad said it was the best summer ever.")


class Failed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failed(msg)


def step(msg):
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


T0 = time.monotonic()


def timeout_scale():
    if os.environ.get("PD_BROWSER_TIMEOUT_SCALE"):
        return float(os.environ["PD_BROWSER_TIMEOUT_SCALE"])
    return 3.0 if "address" in os.environ.get("PD_SANITIZE", "") else 1.0


SCALE = timeout_scale()


# ---- the daemon ------------------------------------------------------------------


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http(method, port, path, body=None, token=None, timeout=30):
    """(status, parsed JSON or text) from the daemon; never raises on a status."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout * SCALE) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    text = raw.decode("utf-8", "replace")
    if "json" in (headers.get("Content-Type") or ""):
        try:
            return status, json.loads(text), headers
        except ValueError:
            pass
    return status, text, headers


class Daemon:
    def __init__(self, prefixd, model, work):
        self.prefixd, self.model, self.work = prefixd, model, work
        self.proc = None
        self.log_path = os.path.join(work, "prefixd.log")

    def log(self, n=4000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def write_config(self):
        store = os.path.join(self.work, "store")
        conf = os.path.join(self.work, "prefixd.conf")
        with open(conf, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # it holds admin.token
            f.write(f"""[server]
listen = 127.0.0.1
port = {self.port}
model_names = stories

[admin]
token = {TOKEN}
listen = 127.0.0.1
port = {self.admin_port}

[model]
path = {self.model}
n_threads = 2

[cache]
path = {store}
map_size_mb = 64

[compression]
# The stories here are a few hundred tokens; the default (256) would store
# shorter ones uncompressed.
min_prefix_tokens = 32
""")
        return conf

    def start(self, timeout=60):
        timeout *= SCALE
        for attempt in range(3):
            self.port, self.admin_port = free_port(), free_port()
            conf = self.write_config()
            logf = open(self.log_path, "ab")
            self.proc = subprocess.Popen([self.prefixd, "--config", conf], stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf, start_new_session=True)
            logf.close()
            t_end = time.monotonic() + timeout
            while time.monotonic() < t_end:
                if self.proc.poll() is not None:
                    if "in use" in self.log() and attempt < 2:
                        break  # a port taken between free_port() and the bind
                    raise Failed(f"prefixd exited with {self.proc.returncode} while starting:\n{self.log()}")
                try:
                    status, _, _ = http("GET", self.port, "/health", timeout=2)
                    if status == 200:
                        return self
                except OSError:
                    pass
                time.sleep(0.1)
            else:
                raise Failed(f"prefixd did not answer 200 on /health within {timeout:.0f} s:\n{self.log()}")
        raise Failed(f"prefixd could not bind its ports:\n{self.log()}")

    def stop(self):
        """SIGTERM, then SIGKILL if it does not drain in time; returns the
        exit status (None when it never started)."""
        if self.proc is None:
            return None
        for sig, wait_s in ((signal.SIGTERM, 20 * SCALE), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()


# ---- the test ----------------------------------------------------------------------


class ConsoleTest:
    def __init__(self, browser, daemon, shots):
        self.b, self.d, self.shots = browser, daemon, shots
        self.ui = f"http://127.0.0.1:{daemon.admin_port}/admin/ui/"

    # helpers

    def admin(self, method, path, body=None):
        return http(method, self.d.admin_port, path, body, token=TOKEN)

    def shot(self, name, show=None):
        """A screenshot of the page scrolled to the top, or to `show`'s
        element at the bottom of the view. The page must fit the 1280 px
        width: a horizontal scroll bar is a layout bug an operator sees."""
        overflow = self.b.evaluate("(() => { const d = document.documentElement;"
                                   " return d.scrollWidth > d.clientWidth ? d.scrollWidth : 0; })()")
        check(not overflow, f"the {name} page is {overflow} px wide: wider than the {self.b.width} px window "
                            f"(a horizontal scroll bar)")
        if show:
            self.b.call("s => document.querySelector(s).scrollIntoView({block: 'end'})", show)
        else:
            self.b.evaluate("window.scrollTo(0, 0)")
        self.b.pump(0.1)
        path = self.b.screenshot(os.path.join(self.shots, f"{name}.png"))
        step(f"screenshot {path}")

    def no_errors(self, where, allow=lambda e: False):
        errors = [e for e in self.b.take_errors() if not allow(e)]
        check(not errors, f"JavaScript/console errors {where}:\n" +
              "\n".join(f"  {e['kind']}: {e['text']} {e['url']}" for e in errors))
        check(not self.b.js_dialogs, f"the console used alert/confirm/prompt {where} (the contract wants "
                                     f"dialog#confirm-dialog): {self.b.js_dialogs}")

    def page_ready(self, page, timeout=None):
        self.b.wait_for(f"(() => {{ const m = document.querySelector('main#page');"
                        f" return m && m.dataset.page === {json.dumps(page)} && m.dataset.ready === '1'; }})()",
                        timeout=timeout, what=f"main#page[data-page={page}][data-ready=1]")

    def go(self, nav, page):
        """Uses the nav link, as a person would, and waits for the page."""
        self.b.click(f"nav a[data-nav={nav}]")
        self.page_ready(page)

    def number(self, selector):
        text = self.b.text(selector)
        check(text is not None, f"{selector} is missing")
        m = re.search(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text.replace(",", ""))
        return (float(m.group(0)) if m else None), text

    def row_ids(self):
        return self.b.evaluate("[...document.querySelectorAll('#prefixes-table tr[data-prefix-id]')]"
                               ".filter(r => r.offsetParent !== null).map(r => r.dataset.prefixId)")

    # steps

    def static_files(self):
        step("static files: headers, and nothing on the public listener")
        status, body, headers = http("GET", self.d.admin_port, "/admin/ui/")
        check(status == 200, f"GET /admin/ui/ on the admin port: {status} {str(body)[:200]}")
        csp = headers.get("Content-Security-Policy") or ""
        check("script-src 'self'" in csp and "frame-ancestors 'none'" in csp,
              f"/admin/ui/ Content-Security-Policy is {csp!r}")
        check("text/html" in (headers.get("Content-Type") or ""), f"/admin/ui/ Content-Type {headers.get('Content-Type')}")
        status, _, _ = http("GET", self.d.port, "/admin/ui/")
        check(status == 404, f"GET /admin/ui/ on the public listener answered {status}, not 404 "
                             f"(admin.port is set: the console belongs to the admin listener only)")
        check(TOKEN not in str(body), "the admin token appears in index.html")

    def login(self):
        step(f"login at {self.ui}")
        self.b.navigate(self.ui)
        self.b.wait_for(selector="form#login-form", visible=True)
        self.no_errors("loading the login page")
        self.shot("login")
        self.b.type("#login-token", WRONG_TOKEN)
        self.b.click("#login-submit")
        self.b.wait_for("(() => { const e = document.querySelector('#login-error');"
                        " return e && e.offsetParent !== null && e.textContent.trim().length > 0; })()",
                        what="#login-error with text after a wrong token")
        check(self.b.visible("form#login-form"), "the login form went away after a wrong token")
        check(not self.b.evaluate("sessionStorage.getItem('prefixd.admin_token')"),
              "a wrong token was kept in sessionStorage")
        # Chromium logs the refused check (401) as a failed resource load.
        self.no_errors("after a wrong token", allow=lambda e: e["kind"] == "log.network" and "401" in e["text"])
        self.b.type("#login-token", TOKEN)
        self.b.click("#login-submit")
        self.page_ready("prefixes")
        check(self.b.evaluate("sessionStorage.getItem('prefixd.admin_token')") == TOKEN,
              "after login sessionStorage['prefixd.admin_token'] is not the token")
        check(self.b.visible("#prefixes-empty"), "#prefixes-empty is not visible with an empty store")
        self.no_errors("logging in")

    def register(self, *, text, policy=None, retention=None, quality=None, screenshot=None):
        """Registers text through the form; returns (prefix id, the
        progress values seen)."""
        self.go("register", "register")
        self.b.wait_for("document.querySelectorAll('#register-policy option').length > 0",
                        what="#register-policy options from /admin/v1/policies")
        status, policies, _ = self.admin("GET", "/admin/v1/policies")
        check(status == 200, f"GET /admin/v1/policies: {status} {policies}")
        names = self.b.evaluate("[...document.querySelectorAll('#register-policy option')].map(o => o.value)")
        api_names = [p["name"] for p in policies["data"]]
        check(sorted(names) == sorted(api_names), f"#register-policy options {names} != /admin/v1/policies {api_names}")
        default_name = policies["default"].split(":")[0]
        if policy is None:
            chosen = self.b.evaluate("document.querySelector('#register-policy').value")
            check(chosen == default_name, f"#register-policy starts at {chosen!r}, not the daemon default {default_name!r}")
            policy = chosen
        else:
            self.b.select("#register-policy", policy)
        keys = next(p["keys"] for p in policies["data"] if p["name"] == policy)
        self.b.wait_for("(() => { const t = document.querySelector('#register-keys');"
                        f" return t && {json.dumps([k['name'] for k in keys])}.every(k => t.textContent.includes(k)); }})()",
                        what=f"#register-keys to list {policy}'s keys {[k['name'] for k in keys]}")
        self.b.select("#register-mode", "text")
        self.b.type("#register-text", text)
        self.b.type("#register-retention", "" if retention is None else str(retention))
        self.b.type("#register-quality", "" if quality is None else str(quality))
        self.b.click("#register-submit")
        # Watch the job closely: progress never goes back and ends at done.
        seen, states = [], []
        t_end = time.monotonic() + 60 * SCALE
        while True:
            s = self.b.evaluate("""(() => {
                const st = document.querySelector('#job-status');
                const p = document.querySelector('progress#job-progress');
                const ph = document.querySelector('#job-phase');
                return st ? {state: st.dataset.state || '', progress: p ? p.value : null,
                             max: p ? p.max : null, phase: ph ? ph.textContent : ''} : null;
            })()""")
            if s and s["state"]:
                if not states or states[-1] != s["state"]:
                    states.append(s["state"])
                if s["progress"] is not None and s["max"]:
                    v = s["progress"] / s["max"]
                    if not seen or seen[-1] != v:
                        seen.append(v)
                if s["state"] in ("done", "failed"):
                    break
            check(time.monotonic() < t_end, f"#job-status did not reach done within {60 * SCALE:.0f} s "
                                            f"(states {states}, progress {seen}, last {s})")
            self.b.pump(0.03)
        if s["state"] == "failed":
            raise Failed(f"the registration job failed: #job-error says {self.b.text('#job-error')!r}")
        check(all(a <= b + 1e-9 for a, b in zip(seen, seen[1:])), f"#job-progress went back: {seen}")
        check(seen and abs(seen[-1] - 1.0) < 1e-6, f"#job-progress did not end at 1 when done: {seen}")
        # These jobs take well under a second on stories260K and the page
        # polls every 250-500 ms, so the page may show no step in between;
        # it must show the job unfinished before it shows it done.
        check(seen[0] < 1.0 and states[0] in ("queued", "running"),
              f"#job-status showed the job done without showing it queued/running first: states {states}, progress {seen}")
        step(f"job states {states}, progress {[round(v, 3) for v in seen]}")
        href = self.b.wait_for("document.querySelector('a#job-prefix-link')?.getAttribute('href')",
                               what="a#job-prefix-link when the job is done")
        m = re.fullmatch(r"#/prefix/([0-9a-f]{64})", href)
        check(m, f"a#job-prefix-link href is {href!r}, not #/prefix/<64 hex>")
        if screenshot:
            self.shot(screenshot, show="#job-status")
        self.no_errors(f"registering with {policy}")
        return m.group(1), seen

    def prefixes_row(self, pid):
        step("the prefixes table")
        self.go("prefixes", "prefixes")
        sel = f"#prefixes-table tr[data-prefix-id='{pid}']"
        self.b.wait_for(selector=sel, visible=True, what=f"the row of prefix {pid[:12]}")
        status, p, _ = self.admin("GET", f"/admin/v1/prefixes/{pid}")
        check(status == 200, f"GET /admin/v1/prefixes/{pid}: {status}")
        row = self.b.text(sel)
        check(str(p["tokens"]) in row, f"the row does not show tokens={p['tokens']}: {row!r}")
        check(p["policy"].split(":")[0] in row, f"the row does not show the policy {p['policy']!r}: {row!r}")
        check(self.b.exists(sel + " a[data-action=open]") and self.b.exists(sel + " button[data-action=pin]")
              and self.b.exists(sel + " button[data-action=delete]"), f"the row lacks open/pin/delete: {row!r}")
        self.no_errors("on the prefixes page")
        return p

    def filter_and_sort(self, ids):
        step("filter and sort")
        both = self.row_ids()
        check(sorted(both) == sorted(ids), f"rows {both} != registered {ids}")
        self.b.type("#prefixes-filter", ids[0][:10])
        self.b.wait_for(f"[...document.querySelectorAll('#prefixes-table tr[data-prefix-id]')]"
                        f".filter(r => r.offsetParent !== null).map(r => r.dataset.prefixId).join() === '{ids[0]}'",
                        what=f"#prefixes-filter {ids[0][:10]!r} to leave one row")
        self.b.type("#prefixes-filter", "")
        self.b.wait_for(f"[...document.querySelectorAll('#prefixes-table tr[data-prefix-id]')]"
                        f".filter(r => r.offsetParent !== null).length === {len(ids)}",
                        what="all rows back after clearing the filter")
        toks = {i: self.admin("GET", f"/admin/v1/prefixes/{i}")[1]["tokens"] for i in ids}
        orders = []
        for _ in range(2):
            self.b.click("#prefixes-table th[data-sort=tokens]")
            self.b.pump(0.2)
            orders.append([toks[i] for i in self.row_ids()])
        if len(set(toks.values())) > 1:
            check(orders[0] in (sorted(orders[0]), sorted(orders[0], reverse=True))
                  and orders[1] == orders[0][::-1],
                  f"clicking th[data-sort=tokens] twice did not sort by tokens one way, then the other: {orders}")
        self.no_errors("filtering and sorting")

    def detail(self, pid, expect_chart, screenshot=None):
        step(f"detail of {pid[:12]}")
        self.b.click(f"#prefixes-table tr[data-prefix-id='{pid}'] a[data-action=open]")
        self.page_ready("prefix")
        self.b.wait_for(selector=f"section#prefix-detail[data-prefix-id='{pid}']", what="section#prefix-detail")
        status, kept, _ = self.admin("GET", f"/admin/v1/prefixes/{pid}/kept")
        check(status == 200, f"GET /admin/v1/prefixes/{pid}/kept: {status} {kept}")
        check((kept["n_layer"], kept["n_head_kv"]) == (MODEL_N_LAYER, MODEL_N_HEAD_KV),
              f"/kept says {kept['n_layer']} layers x {kept['n_head_kv']} kv heads; stories260K has 5 x 4")
        cells = kept["n_layer"] * kept["n_head_kv"]
        n = self.b.count("svg#heat-strip rect[data-layer][data-head]")
        check(n == cells, f"svg#heat-strip has {n} rect[data-layer][data-head], expected n_layer*n_head_kv = {cells}")
        pairs = self.b.evaluate("[...document.querySelectorAll('svg#heat-strip rect[data-layer][data-head]')]"
                                ".map(r => r.dataset.layer + ':' + r.dataset.head)")
        want = {f"{l}:{h}" for l in range(kept["n_layer"]) for h in range(kept["n_head_kv"])}
        check(set(pairs) == want, f"svg#heat-strip cells {sorted(set(pairs))} are not every (layer, head) pair")
        status, p, _ = self.admin("GET", f"/admin/v1/prefixes/{pid}")
        quality = self.b.text("table#prefix-quality")
        check(quality is not None, "table#prefix-quality is missing")
        check(str(p["tokens"]) in quality, f"table#prefix-quality does not show tokens={p['tokens']}: {quality!r}")
        ret = p["quality"]["retention"]
        check(ret is None or f"{ret:g}"[:4] in quality or f"{ret:.2f}" in quality,
              f"table#prefix-quality does not show retention {ret}: {quality!r}")
        cal = p.get("calibration")
        check((cal is not None) == expect_chart, f"calibration is {cal!r}; expected {'a curve' if expect_chart else 'null'}")
        if cal is None:
            check(self.b.visible("#calibration-none") and not self.b.exists("svg#calibration-chart"),
                  "no calibration: #calibration-none should show and svg#calibration-chart should not exist")
        else:
            check(self.b.exists("svg#calibration-chart path.curve"), "svg#calibration-chart path.curve is missing")
            d = self.b.evaluate("document.querySelector('svg#calibration-chart path.curve').getAttribute('d')")
            check(d and len(re.findall(r"[-\d.]+", d)) >= 8, f"path.curve has no real curve: d={d!r}")
            points = self.b.count("svg#calibration-chart circle.point")
            check(points == len(cal["points"]),
                  f"svg#calibration-chart has {points} circle.point, the calibration has {len(cal['points'])} points")
        if kept["spans"]:
            check(self.b.exists("table#span-rates"), "the prefix has spans but table#span-rates is missing")
        else:
            check(self.b.exists("#span-rates-none"), "no spans: #span-rates-none is missing")
        if screenshot:
            self.shot(screenshot)
        self.no_errors("on the detail page")

    def playground(self, pid, text):
        step("playground")
        self.go("playground", "playground")
        self.b.select("#play-endpoint", "completions")
        self.b.type("#play-prompt", text + " Then")
        self.b.type("#play-namespace", "")
        self.b.type("#play-max-tokens", "12")
        self.b.click("#play-submit")
        state = self.b.wait_for("(() => { const s = document.querySelector('#play-status')?.dataset.state;"
                                " return s === 'done' || s === 'error' ? s : null; })()",
                                timeout=60 * SCALE, what="#play-status data-state done (the streamed completion)")
        check(state == "done", f"#play-status is error: {self.b.text('#play-status')!r} / {self.b.text('#play-output')!r}")
        out = self.b.text("pre#play-output") or ""
        check(out.strip(), "pre#play-output is empty after a completed stream")
        cached, raw = self.number("#play-cached-tokens")
        check(cached is not None and cached > 0, f"#play-cached-tokens is {raw!r}; expected > 0 (the prompt starts "
                                                 f"with the registered prefix)")
        shown = self.b.text("pre#play-prefix") or ""
        check(pid in shown, f"pre#play-prefix does not show prefix {pid}: {shown[:300]!r}")
        step(f"played: {cached:g} cached tokens, output {out.strip()[:60]!r}")
        self.shot("playground")
        self.no_errors("in the playground")

    def traffic(self, n_prefixes):
        step("traffic")
        self.go("traffic", "traffic")
        self.b.wait_for("Number(document.querySelector('section#traffic')?.dataset.updated) >= 1",
                        what="section#traffic[data-updated>=1]")
        for i in range(3):
            status, body, _ = http("POST", self.d.port, "/v1/completions",
                                   {"model": "stories", "prompt": STORY_B + " Then", "max_tokens": 4})
            check(status == 200, f"completion {i} on the public port: {status} {str(body)[:200]}")
        self.b.wait_for("(() => { const v = document.querySelector('[data-metric=request_rate] .value');"
                        " const m = v && v.textContent.replace(/,/g, '').match(/\\d+(\\.\\d+)?(e[-+]?\\d+)?/);"
                        " return m && Number(m[0]) > 0; })()", timeout=15 * SCALE,
                        what="[data-metric=request_rate] .value > 0 after 3 completions")
        metrics = ["request_rate", "ttft_p50", "ttft_p95", "tokens_per_s", "prefix_hit_rate", "auto_hit_rate",
                   "hot_tier_bytes", "store_prefixes"]
        values = {}
        for m in metrics:
            check(self.b.exists(f"[data-metric={m}] .value"), f"the traffic tile [data-metric={m}] .value is missing")
            values[m] = (self.b.text(f"[data-metric={m}] .value") or "").strip()
            check(values[m], f"the traffic tile [data-metric={m}] has an empty value")
        stored, raw = self.number("[data-metric=store_prefixes] .value")
        check(stored == n_prefixes, f"[data-metric=store_prefixes] shows {raw!r}, the store has {n_prefixes}")
        updated = self.b.evaluate("Number(document.querySelector('section#traffic').dataset.updated)")
        step(f"traffic after {updated} refreshes: {values}")
        self.shot("traffic")
        self.no_errors("on the traffic page")

    def delete(self, pid):
        step(f"delete {pid[:12]} (cancel, then ok)")
        self.go("prefixes", "prefixes")
        row = f"#prefixes-table tr[data-prefix-id='{pid}']"
        self.b.click(row + " button[data-action=delete]")
        self.b.wait_for("document.querySelector('dialog#confirm-dialog')?.open === true", what="dialog#confirm-dialog to open")
        check(pid[:8] in (self.b.text("#confirm-text") or ""),
              f"#confirm-text does not name the prefix: {self.b.text('#confirm-text')!r}")
        self.b.dialog("dialog#confirm-dialog", "#confirm-cancel")
        self.b.pump(0.5)
        check(self.b.exists(row), "the row went away although the deletion was cancelled")
        status, _, _ = self.admin("GET", f"/admin/v1/prefixes/{pid}")
        check(status == 200, f"after a cancelled delete GET /admin/v1/prefixes/{pid} is {status}")
        self.b.click(row + " button[data-action=delete]")
        self.b.dialog("dialog#confirm-dialog", "#confirm-ok")
        self.b.wait_for(f"document.querySelector({json.dumps(row)}) === null", what=f"the row of {pid[:12]} to go")
        status, body, _ = self.admin("GET", f"/admin/v1/prefixes/{pid}")
        check(status == 404, f"after the delete GET /admin/v1/prefixes/{pid} is {status}, not 404: {str(body)[:200]}")
        self.no_errors("deleting")

    def token_hygiene(self):
        step("the token: only in sessionStorage, never in a URL")
        urls = [r["url"] for r in self.b.requests]
        check(urls, "no network requests were recorded")
        leaked = [u for u in urls if TOKEN in u]
        check(not leaked, f"the admin token appears in request URLs: {leaked[:3]}")
        check(TOKEN not in self.b.evaluate("location.href"), "the admin token is in location.href")
        check(TOKEN not in self.b.evaluate("document.cookie"), "the admin token is in a cookie")
        local = self.b.evaluate("JSON.stringify(Object.assign({}, localStorage))")
        check(TOKEN not in local, "the admin token is in localStorage")
        check(self.b.evaluate("sessionStorage.getItem('prefixd.admin_token')") == TOKEN,
              "sessionStorage['prefixd.admin_token'] is not the token")
        data_calls = [r for r in self.b.requests if "/admin/v1/" in r["url"]]
        check(data_calls, "the console made no /admin/v1/ calls")
        bad = [r["url"] for r in data_calls
               if r["headers"].get("Authorization", r["headers"].get("authorization", "")) not in
               (f"Bearer {TOKEN}", f"Bearer {WRONG_TOKEN}")]
        check(not bad, f"/admin/v1/ calls without the Bearer token: {bad[:3]}")

    def logout(self):
        step("logout")
        self.b.click("button#logout")
        self.b.wait_for(selector="form#login-form", visible=True, what="the login form after logout")
        check(not self.b.evaluate("sessionStorage.getItem('prefixd.admin_token')"),
              "logout left the token in sessionStorage")
        self.no_errors("logging out")

    def run(self):
        self.static_files()
        self.login()
        a_id, _ = self.register(text=STORY_A, policy="knorm", retention=0.5)
        a = self.prefixes_row(a_id)
        check(abs(a["quality"]["retention"] - 0.5) < 1e-6, f"prefix A's retention is {a['quality']['retention']}, not 0.5")
        self.detail(a_id, expect_chart=False)
        b_id, _ = self.register(text=STORY_B, quality=1.5, screenshot="register")
        self.b.click("a#job-prefix-link")
        self.page_ready("prefix")
        self.prefixes_row(b_id)
        self.filter_and_sort([a_id, b_id])
        self.shot("prefixes")
        self.detail(b_id, expect_chart=True, screenshot="prefix-detail")
        self.playground(a_id, STORY_A)
        self.traffic(2)
        self.delete(a_id)
        self.token_hygiene()
        self.logout()


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    chromium = cdp.find_chromium()
    if not chromium:
        missing_dependency("chromium is not on PATH")
    prefixd = os.environ.get("PD_PREFIXD") or os.path.join(ROOT, "build", "prefixd")
    check(os.access(prefixd, os.X_OK), f"no prefixd binary at {prefixd} (set PD_PREFIXD)")
    shared = os.environ.get("PD_SHARED_MODELS") or os.path.join(ROOT, "..", "shared", "models")
    model = os.path.join(shared, "tinystories", "stories260K.gguf")
    check(os.path.isfile(model), f"no model at {model}: put ../shared/models beside the repo or set PD_SHARED_MODELS")
    work = tempfile.mkdtemp(prefix="prefixd-browser-")
    # Screenshots: $PREFIXD_SCREENSHOTS, else a temporary folder that is
    # removed after a pass and kept (with failure.png) after a failure.
    shots = os.environ.get("PREFIXD_SCREENSHOTS")
    own_shots = not shots
    shots = os.path.abspath(shots) if shots else tempfile.mkdtemp(prefix="prefixd-console-shots-")
    os.makedirs(shots, exist_ok=True)
    step(f"timeout scale {SCALE:g}; daemon {prefixd}; screenshots in {shots}")
    daemon = Daemon(prefixd, model, work)
    browser = None
    ok = False
    # SIGTERM (meson's timeout) ends the run like Ctrl-C: through the
    # finally below, which stops the daemon and Chromium.
    signal.signal(signal.SIGTERM, interrupted)
    try:
        daemon.start()
        step(f"prefixd up: public port {daemon.port}, admin port {daemon.admin_port}")
        browser = cdp.Browser(chromium, timeout_scale=SCALE, log=step)
        browser.start()
        ConsoleTest(browser, daemon, shots).run()
        ok = True
    except (Failed, cdp.CdpError) as e:
        print(f"FAIL: {e}", flush=True)
        if browser is not None and browser.ws is not None:
            try:
                browser.screenshot(os.path.join(shots, "failure.png"))
                print(f"  screenshot of the failure: {os.path.join(shots, 'failure.png')}")
            except Exception:
                pass
        print(f"--- prefixd log (tail) ---\n{daemon.log(3000)}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    except Exception:
        traceback.print_exc()
    finally:
        if browser is not None:
            browser.close()
        rc = daemon.stop()
        if ok and rc != 0:
            # A clean drain exits 0; anything else (an ASan/UBSan report at
            # exit, a crash on shutdown) fails the run.
            ok = False
            print(f"FAIL: prefixd exited with {rc} after SIGTERM:\n{daemon.log(6000)}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        if own_shots and ok:
            shutil.rmtree(shots, ignore_errors=True)
        elif not ok:
            print(f"screenshots kept in {shots}", flush=True)
    elapsed = time.monotonic() - T0
    print(f"{1 if ok else 0} passed, {0 if ok else 1} failed ({elapsed:.1f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
