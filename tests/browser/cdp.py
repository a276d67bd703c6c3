"""A small Chrome DevTools Protocol client for the console's browser test.

Starts a headless Chromium of its own (a fresh profile in a temporary
folder), connects to its page over the DevTools websocket (Debian's
python3-websocket, websocket-client) and drives it the way a person would:
clicks are real mouse events at the element's centre, typing is real text
input. Every JavaScript error, console.error and uncaught exception the page
produces is collected in `errors`, so a test can fail on any of them.

Every call is bounded: a reply that does not come within its timeout raises
CdpError naming the command. `close()` (also through `with Browser() as b`)
ends Chromium's whole process group and removes the profile.

    with Browser() as b:
        b.navigate("http://127.0.0.1:8081/admin/ui/")
        b.wait_for("#login-form", what="the login form")
        b.type("#login-token", "secret")
        b.click("#login-submit")
"""
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import websocket  # Debian: python3-websocket


class CdpError(Exception):
    """A DevTools command failed, timed out, or the page's JavaScript threw."""


def find_chromium():
    """The Chromium binary on PATH (Debian names it `chromium`), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page, driven over CDP.

    timeout_scale multiplies every default timeout (a slow or sanitized
    machine). width x height is the page's viewport (screenshots' size)."""

    def __init__(self, binary=None, timeout_scale=1.0, width=1280, height=800, log=None):
        self.binary = binary or find_chromium()
        if not self.binary:
            raise CdpError("chromium not found on PATH (Debian: apt-get install chromium)")
        self.scale = float(timeout_scale)
        self.width, self.height = width, height
        self.log = log or (lambda msg: None)
        self.proc = None
        self.profile = None
        self.ws = None
        self.next_id = 0
        self.errors = []         # {"kind","text","url"} for every JS error / error log entry
        self.requests = []       # {"url","method","headers"} of every request the page sent
        self.js_dialogs = []     # window.alert/confirm/prompt texts (the console must use <dialog>)
        self.events = []         # other events, kept for debugging (bounded)

    # ---- lifecycle -------------------------------------------------------

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self, timeout=None):
        timeout = self._t(timeout, 40)
        self.profile = tempfile.mkdtemp(prefix="prefixd-chromium-")
        stderr_path = os.path.join(self.profile, "chromium.log")
        argv = [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                f"--window-size={self.width},{self.height + 100}",
                # Nothing outside the machine: no first-run pages, sync,
                # component updates or background fetches.
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--disable-dev-shm-usage", "--password-store=basic",
                "--use-mock-keychain", "--mute-audio", "about:blank"]
        with open(stderr_path, "ab") as errf:
            # Its own session (process group): close() ends every helper
            # process Chromium forks (zygote, renderer, GPU, network).
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=errf, stderr=errf,
                                         start_new_session=True)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        t_end = time.monotonic() + timeout
        port = None
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise CdpError(f"chromium exited with {self.proc.returncode} while starting:\n{self.chromium_log()}")
            try:
                with open(port_file) as f:
                    first = f.readline().strip()
                if first.isdigit():
                    port = int(first)
                    break
            except OSError:
                pass
            time.sleep(0.05)
        if port is None:
            raise CdpError(f"chromium wrote no {port_file} within {timeout:.0f} s:\n{self.chromium_log()}")
        self.port = port
        target = self._page_target(t_end)
        # No Origin header: Chromium refuses websocket clients from other
        # origins unless --remote-allow-origins is given.
        self.ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=max(1.0, t_end - time.monotonic()),
                                              suppress_origin=True)
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self.send(method)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        self.log(f"chromium {self.proc.pid} on DevTools port {port}")
        return self

    def _page_target(self, t_end):
        url = f"http://127.0.0.1:{self.port}/json/list"
        last = None
        while time.monotonic() < t_end:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    targets = json.loads(r.read().decode("utf-8"))
                pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
                if pages:
                    return pages[0]
                last = f"no page among {len(targets)} targets"
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        raise CdpError(f"no page target at {url}: {last}")

    def chromium_log(self, n=3000):
        try:
            with open(os.path.join(self.profile, "chromium.log"), "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except (OSError, TypeError):
            return ""

    def close(self):
        """Ends Chromium (its whole process group) and removes the profile.
        Safe to call twice and after a failed start."""
        if self.ws is not None:
            try:
                self.ws.settimeout(2)
                self.ws.send(json.dumps({"id": self._new_id(), "method": "Browser.close"}))
            except Exception:
                pass
            try:
                self.ws.close()
            except Exception:
                pass
            self.ws = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
            for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
            # The group may outlive its leader: SIGKILL what is left and wait
            # (bounded) until none of it remains.
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.05)
            self.proc = None
        if self.profile:
            shutil.rmtree(self.profile, ignore_errors=True)
            self.profile = None

    # ---- protocol ----------------------------------------------------------

    def _t(self, timeout, default):
        return float(timeout) if timeout is not None else default * self.scale

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def send(self, method, params=None, timeout=None):
        """Sends one command and returns its result; events read meanwhile
        are handled. Raises CdpError on an error reply or a timeout."""
        timeout = self._t(timeout, 20)
        if self.ws is None:
            raise CdpError(f"{method}: not connected")
        msg_id = self._new_id()
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
        t_end = time.monotonic() + timeout
        while True:
            left = t_end - time.monotonic()
            if left <= 0:
                raise CdpError(f"{method}: no reply within {timeout:.1f} s")
            msg = self._recv(left)
            if msg is None:
                continue
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise CdpError(f"{method}: {msg['error'].get('message')} {msg['error'].get('data', '')}".strip())
                return msg.get("result", {})

    def _recv(self, timeout):
        self.ws.settimeout(max(0.01, min(timeout, 1.0)))
        try:
            raw = self.ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        except (websocket.WebSocketConnectionClosedException, OSError) as e:
            raise CdpError(f"DevTools connection lost ({e}); chromium log:\n{self.chromium_log()}")
        msg = json.loads(raw)
        if "method" in msg:
            self._on_event(msg["method"], msg.get("params", {}))
        return msg

    def pump(self, seconds):
        """Handles events for `seconds` (a sleep that keeps reading)."""
        t_end = time.monotonic() + seconds
        while (left := t_end - time.monotonic()) > 0:
            self._recv(left)

    def _on_event(self, method, p):
        if method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            text = (d.get("exception") or {}).get("description") or d.get("text", "exception")
            self.errors.append({"kind": "exception", "text": text, "url": d.get("url", "")})
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            parts = []
            for a in p.get("args", []):
                parts.append(str(a.get("value", a.get("description", a.get("type")))))
            self.errors.append({"kind": "console." + p["type"], "text": " ".join(parts), "url": ""})
        elif method == "Log.entryAdded":
            e = p.get("entry", {})
            if e.get("level") == "error":
                self.errors.append({"kind": "log." + e.get("source", "other"), "text": e.get("text", ""),
                                    "url": e.get("url", "")})
        elif method == "Network.requestWillBeSent":
            r = p.get("request", {})
            self.requests.append({"url": r.get("url", ""), "method": r.get("method", ""),
                                  "headers": r.get("headers", {})})
        elif method == "Page.javascriptDialogOpening":
            # alert/confirm/prompt block the page; dismiss it and let the
            # test see that one was used.
            self.js_dialogs.append(p.get("message", ""))
            self.ws.send(json.dumps({"id": self._new_id(), "method": "Page.handleJavaScriptDialog",
                                     "params": {"accept": False}}))
        elif len(self.events) < 2000:
            self.events.append(method)

    def take_errors(self):
        """The errors collected so far; clears the list."""
        out, self.errors = self.errors, []
        return out

    # ---- page --------------------------------------------------------------

    def navigate(self, url, timeout=None):
        """Loads url and waits until the document has loaded."""
        timeout = self._t(timeout, 20)
        r = self.send("Page.navigate", {"url": url}, timeout=timeout)
        if r.get("errorText"):
            raise CdpError(f"navigate {url}: {r['errorText']}")
        self.wait_for("document.readyState === 'complete'", timeout=timeout, what=f"{url} to load")

    def evaluate(self, expression, await_promise=True, timeout=None):
        """The value of a JavaScript expression in the page (JSON-able values
        by value; a promise is awaited). A thrown error raises CdpError."""
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": await_promise,
                                           "returnByValue": True, "userGesture": True},
                      timeout=timeout)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            text = (d.get("exception") or {}).get("description") or d.get("text")
            raise CdpError(f"JavaScript error in {expression[:120]!r}: {text}")
        return r.get("result", {}).get("value")

    def call(self, func, *args, timeout=None):
        """Calls a JavaScript function source with JSON arguments."""
        return self.evaluate(f"({func})(...{json.dumps(list(args))})", timeout=timeout)

    def wait_for(self, condition=None, *, selector=None, visible=False, timeout=None, what=None,
                 interval=0.1):
        """Polls until a JavaScript `condition` is truthy, or an element
        matching `selector` exists (visible=True: and takes space on the
        page), and returns the condition's value. Raises CdpError naming
        `what` when that does not happen within timeout seconds."""
        timeout = self._t(timeout, 15)
        if selector is not None:
            check = _VISIBLE_JS if visible else "s => document.querySelector(s) !== null"
            condition = f"({check})({json.dumps(selector)})"
            what = what or (f"{selector} to be visible" if visible else f"{selector} to exist")
        t_end = time.monotonic() + timeout
        last_error = None
        while True:
            try:
                value = self.evaluate(condition, timeout=max(1.0, t_end - time.monotonic() + 1))
                if value:
                    return value
            except CdpError as e:
                last_error = e
            if time.monotonic() >= t_end:
                extra = f" (last error: {last_error})" if last_error else ""
                raise CdpError(f"timed out after {timeout:.1f} s waiting for {what or condition}{extra}; "
                               f"page at {self.url()!r}")
            self.pump(interval)

    def url(self):
        try:
            return self.evaluate("location.href", timeout=5)
        except CdpError:
            return "?"

    def exists(self, selector):
        return bool(self.call("s => document.querySelector(s) !== null", selector))

    def visible(self, selector):
        """The element exists and takes space on the page (not display:none,
        not hidden, not zero-sized)."""
        return bool(self.call(_VISIBLE_JS, selector))

    def text(self, selector):
        return self.call("s => { const e = document.querySelector(s); return e ? e.textContent : null; }", selector)

    def count(self, selector):
        return self.call("s => document.querySelectorAll(s).length", selector)

    # ---- input -------------------------------------------------------------

    def click(self, selector, timeout=None):
        """Clicks the element like a mouse: scrolls it into view, then a
        press and release at its centre. Fails when the element is missing,
        invisible, or covered by another element at that point."""
        timeout = self._t(timeout, 10)
        self.wait_for(selector=selector, visible=True, timeout=timeout,
                      what=f"{selector} to be visible (to click it)")
        box = self.call("""s => {
            const e = document.querySelector(s);
            e.scrollIntoView({block: 'center', inline: 'center'});
            const r = e.getBoundingClientRect();
            const x = r.left + r.width / 2, y = r.top + r.height / 2;
            const hit = document.elementFromPoint(x, y);
            return {x, y, hit: hit === null ? null : (hit === e || e.contains(hit)) ? '' :
                    hit.tagName.toLowerCase() + (hit.id ? '#' + hit.id : '')};
        }""", selector)
        if box["hit"] != "":
            raise CdpError(f"click {selector}: its centre is covered by {box['hit'] or 'nothing'}")
        x, y = box["x"], box["y"]
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                   "buttons": 1 if kind == "mousePressed" else 0,
                                                   "clickCount": 1})

    def type(self, selector, text, clear=True):
        """Focuses the field and types text into it (Input.insertText: input
        events as from a keyboard). clear=True empties it first."""
        self.wait_for(selector=selector, visible=True, what=f"{selector} to be visible (to type into it)")
        self.call("""(s, clear) => {
            const e = document.querySelector(s);
            e.scrollIntoView({block: 'center'});
            e.focus();
            if (clear) {
                e.value = '';
                e.dispatchEvent(new Event('input', {bubbles: true}));
            }
        }""", selector, clear)
        if text:
            self.send("Input.insertText", {"text": text})

    def select(self, selector, value):
        """Chooses the <option> with this value, with the input and change
        events a person's choice fires. Fails when no option has it."""
        ok = self.call("""(s, v) => {
            const e = document.querySelector(s);
            if (!e || ![...e.options].some(o => o.value === v)) return false;
            e.focus();
            e.value = v;
            e.dispatchEvent(new Event('input', {bubbles: true}));
            e.dispatchEvent(new Event('change', {bubbles: true}));
            return true;
        }""", selector, value)
        if not ok:
            options = self.call("s => { const e = document.querySelector(s); return e ? [...e.options].map(o => o.value) : null; }",
                                selector)
            raise CdpError(f"select {selector}: no option {value!r} (options: {options})")

    def dialog(self, dialog_selector, button_selector, timeout=None):
        """Answers an HTML <dialog>: waits until it is open, clicks the
        button, waits until it has closed."""
        self.wait_for(f"document.querySelector({json.dumps(dialog_selector)})?.open === true",
                      timeout=timeout, what=f"{dialog_selector} to open")
        self.click(button_selector)
        self.wait_for(f"document.querySelector({json.dumps(dialog_selector)})?.open === false",
                      timeout=timeout, what=f"{dialog_selector} to close after {button_selector}")

    def screenshot(self, path):
        """A PNG of the viewport, written to path."""
        r = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(r["data"]))
        return path


_VISIBLE_JS = """s => {
    const e = document.querySelector(s);
    if (!e) return false;
    const st = getComputedStyle(e);
    if (st.visibility === 'hidden' || st.display === 'none') return false;
    const r = e.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
}"""

