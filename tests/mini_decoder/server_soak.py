#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Soak of `mini_decoder serve`: hostile and careless clients beside a normal one.

Starts the server on a free loopback port, then alternates quiet phases (the normal client
alone) and hostile phases (the normal client beside the attackers of the hostile-client probe:
heads dribbled one byte at a time, idle keep-alive connections, 64,000-letter words, clients
that leave mid-request, floods of header fields, malformed and out-of-range requests, pipelined
and HTTP/1.0 requests, distinct words through /tokenize), and checks that:
  - the normal client's greedy answers never change,
  - its median latency in the hostile phases stays within --max-ratio (2) of the quiet ones,
  - /health, probed every 100 ms from another address, answers within 100 ms at the median and
    within a second always,
  - no request gets a 5xx, and the server's memory stays flat (RSS of the last hostile phase
    within --rss-slack-mib of the first),
  - SIGTERM with streams and dribbling clients open ends each stream with a finish_reason and
    data: [DONE], and the process exits 0 within its grace period and a few seconds.
Every client is bounded in count and time and talks to 127.0.0.x only; the run stops by itself.

  usage: server_soak.py --binary build/ci/apps/mini_decoder/mini_decoder \
             --model models/SmolLM2-135M-Instruct.Q4_1.gguf [--seconds 60] [--out soak.json]
The CI runs it for 60 s; use --seconds 600 (or more) for a longer soak.
"""
import argparse
import http.client
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

PROMPTS = ["What is the capital of France?", "Name three colors.", "Count from one to five."]


def rss_mib(pid):
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


class Server:
    def __init__(self, binary, model, grace):
        cmd = [binary, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
               "--threads", "1", "--fast-tier-mib", "256", "--shutdown-grace", str(grace),
               "--header-timeout", "2", "--request-timeout", "10", "--keep-alive-timeout", "5",
               "--write-timeout", "5"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, errors="replace")
        self.log = []
        self.port = None
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                if "listening on http://127.0.0.1:" in line and self.port is None:
                    self.port = int(line.split("127.0.0.1:")[1].split()[0])
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(120) or self.port is None:
            self.kill()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.log[-20:]))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def post(port, path, body, source="127.0.0.1", timeout=120, headers=None):
    """A whole request on a fresh connection: (status, body text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                   source_address=(source, 0))
    try:
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request("POST", path, body=body if isinstance(body, (bytes, str)) else json.dumps(body),
                  headers=h)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def raw(port, source, timeout=5):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                 source_address=(source, 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return s


def read_all(s, limit=1 << 20):
    out = b""
    try:
        while len(out) < limit:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except OSError:
        pass
    return out


class Soak:
    def __init__(self, args):
        self.args = args
        # The attackers run in a process of their own (forked), so that their Python work
        # neither holds the normal client's interpreter lock nor counts in its latency.
        self.ctx = multiprocessing.get_context("fork")
        self.hostile = self.ctx.Event()
        self.stop = self.ctx.Event()
        self.failures = []
        self.lock = threading.Lock()
        self.counts = {}
        self.sink = None  # in the attackers' process: where failures and counts go

    def fail(self, what):
        if self.sink is not None:
            self.sink.put(("fail", what))
            return
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(what)

    def count(self, what):
        if self.sink is not None:
            self.sink.put(("count", what))
            return
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def check_status(self, who, status, ok):
        self.count(f"{who}:{status}")
        if status >= 500 or status not in ok:
            self.fail(f"{who}: HTTP {status}, wanted one of {sorted(ok)}")

    # --- the attackers (each loops while the run lasts, working in hostile phases) ---------
    def each(self, period, fn):
        while not self.stop.is_set():
            if not self.hostile.wait(0.2):
                continue
            t0 = time.monotonic()
            try:
                fn()
            except OSError:
                pass  # the server closing a hostile connection is what it should do
            except Exception as e:  # noqa: BLE001 - any surprise is a failure of the run
                self.fail(f"{fn.__name__}: {e!r}")
            time.sleep(max(0.0, period - (time.monotonic() - t0)))

    def slowloris(self):
        # 20 connections, each sending its head one byte every half second; reopened when the
        # header timeout closes them.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4000
        conns = []
        while not self.stop.is_set():
            if not self.hostile.is_set():
                for s, _ in conns:
                    s.close()
                conns = []
                self.hostile.wait(0.2)
                continue
            while len(conns) < 20:
                try:
                    conns.append([raw(self.port, "127.0.0.2"), 0])
                except OSError:
                    break
            for c in list(conns):
                s, at = c
                try:
                    s.send(head[at:at + 1])
                    c[1] = (at + 1) % len(head)
                except OSError:
                    s.close()
                    conns.remove(c)
                    self.count("slowloris:closed by the server")
            time.sleep(0.5)
        for s, _ in conns:
            s.close()

    def idle_keepalive(self):
        conns = []
        while not self.stop.is_set():
            if not self.hostile.is_set():
                for s in conns:
                    s.close()
                conns = []
                self.hostile.wait(0.2)
                continue
            while len(conns) < 30:
                s = raw(self.port, "127.0.0.3")
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                s.recv(4096)
                conns.append(s)
            time.sleep(0.5)
            for s in list(conns):  # the keep-alive timeout closes them: open new ones
                try:
                    if s.recv(1, socket.MSG_DONTWAIT) == b"":
                        conns.remove(s)
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    conns.remove(s)
                    s.close()
        for s in conns:
            s.close()

    def giant_word(self):
        word = random.choice(self.words)
        status, _ = post(self.port, "/v1/completions", {"prompt": word, "max_tokens": 4},
                         source="127.0.0.4", timeout=30)
        self.check_status("giant word", status, {400})

    def leaver(self):
        # A long request whose client leaves: whole, or streamed after its first bytes.
        s = raw(self.port, "127.0.0.5")
        body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 400,
                           "ignore_eos": True, "stream": random.random() < 0.5}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(random.uniform(0.05, 0.3))
        s.close()
        self.count("leaver")

    def header_flood(self):
        s = raw(self.port, "127.0.0.6")
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        block = b"".join(b"X-F%d: value\r\n" % i for i in range(2000))
        sent = 0
        try:
            while sent < (1 << 20):
                s.sendall(block)
                sent += len(block)
        except OSError:
            pass
        got = read_all(s, 4096)
        s.close()
        if got and not got.startswith(b"HTTP/1.1 431"):
            self.fail(f"header flood: {got[:40]!r}")
        self.count("header flood")

    JUNK = [
        (b'{"prompt": ', {400}),
        (b'{"prompt": "x", "max_tokens": 1e400}', {400}),
        (b'{"prompt": "x", "temperature": 1e39}', {400}),
        (b'{"prompt": "x", "max_tokens": 18446744073709551615}', {400}),
        (b'{"prompt": "\xff\xfe\xc3", "max_tokens": 2}', {400}),
        (b'{"prompt": "a\\u0000b", "max_tokens": 2}', {200}),
        (b"[" * 10000 + b"]" * 10000, {400}),
        (b'{"prompt": "x", "tools": [{"type": "function"}]}', {400}),
        (b'{"prompt": "x", "frobnicate": true}', {400}),
        (b'{"prompt": "x", "model": "gpt-5"}', {404}),
        (b'{"prompt": "x", "logit_bias": {"-3": 1}}', {400}),
        (b'{"messages": [{"role": "user", "content": [{"type": 1}]}]}', {400}),
    ]

    def junk(self):
        body, ok = random.choice(self.JUNK)
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, _ = post(self.port, path, body, source="127.0.0.7", timeout=30)
        self.check_status("junk", status, ok)
        # Wrong content type, pipelining, HTTP/1.0 and a bad request line, raw.
        status, _ = post(self.port, "/v1/completions", b'{"prompt": "x"}', source="127.0.0.7",
                         headers={"Content-Type": "text/plain"})
        self.check_status("text/plain", status, {415})
        s = raw(self.port, "127.0.0.7")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 3
                  + b"GET /health HTTP/1.0\r\n\r\n")
        got = read_all(s)
        s.close()
        if got.count(b"HTTP/1.1 200") != 4:
            self.fail(f"pipelined: {got.count(b'HTTP/1.1 200')} answers of 4")
        s = raw(self.port, "127.0.0.7")
        s.sendall(b"GARBAGE\r\n\r\n")
        got = read_all(s, 4096)
        s.close()
        if not got.startswith(b"HTTP/1.1 400"):
            self.fail(f"bad request line: {got[:40]!r}")

    def tokenize_churn(self):
        # 10,000 words not seen before (a rotation of a prefix makes a new set each time).
        self.churn += 1
        words = " ".join(f"{w}{self.churn}" for w in self.word_list)
        status, _ = post(self.port, "/tokenize", {"prompt": words}, source="127.0.0.8")
        self.check_status("tokenize", status, {200})

    # --- the observers ----------------------------------------------------------------------
    def health_prober(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2,
                                               source_address=("127.0.0.1", 0))
                c.request("GET", "/health")
                status = c.getresponse().status
                c.close()
                dt = time.monotonic() - t0
            except OSError as e:
                status, dt = 0, 2.0
                self.fail(f"/health: {e!r}")
            if status != 200:
                self.fail(f"/health: HTTP {status}")
            with self.lock:
                self.health.append((self.hostile.is_set(), dt))
            time.sleep(0.1)

    def memory(self):
        while not self.stop.is_set():
            try:
                with self.lock:
                    self.rss.append((self.phase, rss_mib(self.server.proc.pid)))
            except OSError:
                pass
            time.sleep(0.5)

    def normal_client(self):
        i = 0
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                    "temperature": 0}
            hostile = self.hostile.is_set()
            t0 = time.monotonic()
            status, text = post(self.port, "/v1/chat/completions", body)
            dt = time.monotonic() - t0
            if status != 200:
                self.fail(f"normal client: HTTP {status}: {text[:200]}")
                continue
            answer = json.loads(text)["choices"][0]["message"]["content"]
            with self.lock:
                want = self.answers.setdefault(prompt, answer)
                if answer != want:
                    self.fail(f"normal client: {prompt!r} answered {answer!r}, before {want!r}")
                if hostile == self.hostile.is_set():  # the whole request in one kind of phase
                    self.latency.append((hostile, dt))

    # --- the run ------------------------------------------------------------------------------
    def attackers(self, sink):
        """The attackers' process: each attacker a thread, until `stop`.

        Niced: on a 2-core test machine the attackers' own Python work would otherwise take
        the cores the server needs, which no remote attacker does; what the server does for
        their requests still runs at its own priority and counts."""
        os.nice(10)
        self.sink = sink
        rng = random.Random(5)
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.words = ["".join(rng.choice(letters) for _ in range(64000)) for _ in range(4)]
        self.word_list = ["".join(rng.choice(letters) for _ in range(6)) for _ in range(10000)]
        self.churn = 0
        threads = [threading.Thread(target=f, daemon=True)
                   for f in (self.slowloris, self.idle_keepalive)]
        for period, fn in ((1.0, self.giant_word), (1.0, self.leaver), (2.0, self.header_flood),
                           (0.5, self.junk), (3.0, self.tokenize_churn)):
            threads.append(threading.Thread(target=self.each, args=(period, fn), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        sink.put(("done", ""))

    def run(self):
        a = self.args
        self.server = Server(a.binary, a.model, a.grace)
        self.port = self.server.port
        self.health, self.latency, self.rss, self.answers = [], [], [], {}
        self.phase = 0
        sink = self.ctx.Queue()
        child = self.ctx.Process(target=self.attackers, args=(sink,), daemon=True)
        child.start()
        threads = [threading.Thread(target=f, daemon=True)
                   for f in (self.health_prober, self.memory, self.normal_client)]
        for t in threads:
            t.start()
        phases = max(4, 2 * round(a.seconds / 30))  # quiet, hostile, quiet, hostile, ...
        for p in range(phases):
            self.phase = p
            if p % 2 == 1:
                self.hostile.set()
            else:
                self.hostile.clear()
            time.sleep(a.seconds / phases)
        self.hostile.clear()
        self.stop.set()
        for t in threads:
            t.join(timeout=150)
        while True:  # what the attackers found, until they are done
            try:
                kind, what = sink.get(timeout=150)
            except Exception:  # noqa: BLE001 - queue.Empty: they did not finish
                self.fail("the attackers did not finish")
                break
            if kind == "done":
                break
            (self.fail if kind == "fail" else self.count)(what)
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        self.sigterm()
        return self.report()

    def sigterm(self):
        # Streams and dribbling clients open, then SIGTERM.
        def stream(out):
            try:
                s = raw(self.port, "127.0.0.9", timeout=60)
                body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 2000,
                                   "ignore_eos": True, "stream": True}).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
                out.append(read_all(s, 64 << 20))
                s.close()
            except OSError as e:
                self.fail(f"sigterm stream: {e!r}")
        got = []
        streams = [threading.Thread(target=stream, args=(got,)) for _ in range(2)]
        for t in streams:
            t.start()
        slow = []
        for _ in range(3):
            s = raw(self.port, "127.0.0.2")
            s.send(b"GET /health HTTP/1.1\r\nHo")
            slow.append(s)
        time.sleep(1.0)
        t0 = time.monotonic()
        self.server.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.server.proc.wait(timeout=self.args.grace + 15)
        except subprocess.TimeoutExpired:
            rc = None
            self.fail("SIGTERM: the server still runs after its grace period and 15 s")
            self.server.kill()
        self.exit_seconds = time.monotonic() - t0
        if rc not in (0, None):
            self.fail(f"SIGTERM: exit code {rc}")
        for t in streams:
            t.join(timeout=30)
        for s in slow:
            s.close()
        for body in got:
            text = body.decode("utf-8", "replace")
            if '"finish_reason":"' not in text.replace(": ", ":") or "data: [DONE]" not in text:
                self.fail(f"SIGTERM: a stream ended without finish_reason and [DONE]: "
                          f"...{text[-200:]!r}")

    def report(self):
        a = self.args
        quiet = [d for h, d in self.latency if not h]
        loud = [d for h, d in self.latency if h]
        health_loud = [d for h, d in self.health if h]
        result = {"seconds": a.seconds, "requests": {"quiet": len(quiet), "hostile": len(loud)},
                  "counts": self.counts, "sigterm_exit_seconds": round(self.exit_seconds, 3)}
        if quiet and loud:
            q, l = statistics.median(quiet), statistics.median(loud)
            result["normal_latency_median_s"] = {"quiet": round(q, 4), "hostile": round(l, 4),
                                                 "ratio": round(l / q, 3)}
            if l > a.max_ratio * q:
                self.fail(f"the normal client's median latency is {l:.3f} s beside the hostile "
                          f"clients, {l / q:.2f}x its {q:.3f} s alone (at most {a.max_ratio}x)")
        else:
            self.fail("the normal client finished no request in some phase")
        if health_loud:
            med, most = statistics.median(health_loud), max(health_loud)
            result["health_s"] = {"median": round(med, 4), "max": round(most, 4),
                                  "samples": len(health_loud)}
            if med > 0.1 or most > 1.0:
                self.fail(f"/health beside the hostile clients: median {med:.3f} s, most "
                          f"{most:.3f} s (want 0.1 and 1.0)")
        hostile_phases = sorted({p for p, _ in self.rss if p % 2 == 1})
        if len(hostile_phases) >= 2:
            first = max(r for p, r in self.rss if p == hostile_phases[0])
            last = max(r for p, r in self.rss if p == hostile_phases[-1])
            result["rss_mib"] = {"first_hostile_phase": round(first, 1),
                                 "last_hostile_phase": round(last, 1)}
            if last - first > a.rss_slack_mib:
                self.fail(f"memory grew from {first:.0f} MiB to {last:.0f} MiB between the first "
                          f"and last hostile phases (at most {a.rss_slack_mib} MiB)")
        result["failures"] = self.failures
        print(json.dumps(result, indent=2))
        if a.out:
            with open(a.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
        for f in self.failures:
            print("error:", f, file=sys.stderr)
        if self.failures:
            print("server log (last lines):", *self.server.log[-15:], sep="\n  ", file=sys.stderr)
        print(f"server_soak: {0 if self.failures else 1} passed, {1 if self.failures else 0} failed")
        return 1 if self.failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", required=True, help="the mini_decoder program")
    p.add_argument("--model", required=True, help="a model file (SmolLM2 in the CI)")
    p.add_argument("--seconds", type=float, default=60, help="length of the soak (default 60)")
    p.add_argument("--grace", type=float, default=2, help="--shutdown-grace of the server")
    p.add_argument("--max-ratio", type=float, default=2.0,
                   help="the normal client's hostile/quiet median latency, at most")
    p.add_argument("--rss-slack-mib", type=float, default=64,
                   help="RSS growth allowed between the first and last hostile phases")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    if not os.path.exists(args.model):
        print(f"error: {args.model} is missing (scripts/fetch-models.sh fetches SmolLM2)",
              file=sys.stderr)
        return 1
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        os.environ.pop(var, None)
    soak = Soak(args)
    try:
        return soak.run()
    finally:
        if getattr(soak, "server", None):
            soak.server.kill()


if __name__ == "__main__":
    sys.exit(main())
