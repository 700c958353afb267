# SPDX-License-Identifier: Apache-2.0
"""llama-server with OasisKV against the stock KV cache of the same build, through the openai
client (integrations/llama.cpp/test.sh runs it).

For each server setup, a stock server and an OasisKV one answer the same requests greedily, and
the answers must be equal token for token (text and count): a first request, then a second whose
prompt starts with the first's prompt and answer (the slot reuses the cached prefix and cuts
the rest: OasisKV's truncate), with prompt-lookup speculative decoding and with a draft model
(rejected drafts are cut the same way). --needle runs the long-context check instead: an 8k-token
prompt with one fact in its middle, asked at the end, answered by OasisKV at a budget of 1024
tokens and by the stock cache.

    python3 test_server.py --server BIN --model GGUF [--threads N] [--needle]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from openai import OpenAI


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process; stops with the `with` block."""

    def __init__(self, binary, model, args, threads, label):
        self.port = free_port()
        self.label = label
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        cmd = [binary, "-m", model, "--port", str(self.port), "--host", "127.0.0.1", "-t", str(threads),
               "-tb", str(threads), "-np", "1", "--no-warmup"] + args
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                             timeout=600)

    def __enter__(self):
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label}: llama-server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.label}: llama-server did not come up:\n{self.tail()}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)

    def tail(self, n=30):
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def complete(self, prompt, max_tokens):
        """Greedy completion: (text, completion tokens, timings)."""
        r = self.client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           extra_body={"top_k": 1, "seed": 1})
        extra = r.model_extra or {}
        return r.choices[0].text, r.usage.completion_tokens, extra.get("timings", {})

    def chat(self, content, max_tokens):
        r = self.client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                                max_tokens=max_tokens, temperature=0.0,
                                                extra_body={"top_k": 1, "seed": 1})
        return r.choices[0].message.content, r.usage.completion_tokens, r.usage.prompt_tokens


failures = 0


def check(name, ok, detail=""):
    global failures
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f"\n     {detail}"), flush=True)
    failures += 0 if ok else 1


STORY = "The three most important inventions of the last century are"
FOLLOW_UP = "\n\nThe days of the week are Monday,"
LIST = ("Here is a list of fruits: apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum. "
        "Here is the same list again: apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum. "
        "And once more: apple, banana,")


def referee(o, args, prompt, max_tokens):
    """After a mismatch: whether the stock cache's own two attention paths (flash and matrix) agree
    on this prompt here. Where they do not, the prompt sits on a rounding tie on this machine and
    says nothing about OasisKV; the test still fails, naming it."""
    with Server(o.server, o.model, args + ["-fa", "off"], o.threads, "stock, no flash attention") as r:
        return r.complete(prompt, max_tokens)[:2]


def compare_setup(a, b, name, spec, o, args):
    """The same requests on the stock server `a` and the OasisKV server `b`."""
    def why(prompt, max_tokens, got_a, got_b, extra=""):
        r = referee(o, args, prompt, max_tokens)
        tie = "" if r == got_a else "\n     (stock without flash attention gives another answer: a rounding tie here)"
        return f"stock {got_a[0]!r}\n     oasis {got_b[0]!r}{extra}{tie}"

    text_a, n_a, _ = a.complete(STORY, 48)
    text_b, n_b, _ = b.complete(STORY, 48)
    same = (text_a, n_a) == (text_b, n_b)
    check(f"{name}: first request equals stock ({n_b} tokens)", same,
          "" if same else why(STORY, 48, (text_a, n_a), (text_b, n_b)))

    second = STORY + text_a + FOLLOW_UP
    text_a, n_a, t_a = a.complete(second, 48)
    text_b, n_b, t_b = b.complete(second, 48)
    same = (text_a, n_a) == (text_b, n_b)
    check(f"{name}: second request reuses the cached prefix ({t_b.get('cache_n')} tokens) and equals stock",
          same and t_b.get("cache_n", 0) > 0,
          "" if same else why(second, 48, (text_a, n_a), (text_b, n_b), f" (cache_n {t_b.get('cache_n')})"))

    if spec:
        text_a, n_a, t_a = a.complete(LIST, 40)
        text_b, n_b, t_b = b.complete(LIST, 40)
        same = (text_a, n_a) == (text_b, n_b)
        check(f"{name}: speculative decoding ({t_b.get('draft_n_accepted')} of {t_b.get('draft_n')} drafts "
              "accepted) equals stock", same and t_b.get("draft_n", 0) > 0,
              f"drafts {t_b.get('draft_n')}" if same else why(LIST, 40, (text_a, n_a), (text_b, n_b)))


def needle_prompt():
    """About 7.5k tokens of filler with one fact in the middle, then the question."""
    filler = ("The committee met again to review the quarterly figures for the northern warehouses, and after "
              "a long discussion of shipping schedules, staffing and the cost of fuel, it agreed to meet again "
              "the following week. ")
    fact = " Remember this: the secret password of the vault is BLUE-HERON-42. "
    half = filler * 96
    return half + fact + half + "\n\nWhat is the secret password of the vault?"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--needle", action="store_true")
    o = p.parse_args()

    if o.needle:
        prompt = needle_prompt()
        answers = []
        for label, extra in (("stock", []), ("oasis", ["--oasis-budget", "1024"])):
            with Server(o.server, o.model, ["-c", "8192"] + extra, o.threads, label) as s:
                answers.append(s.chat(prompt, 24))
        check(f"needle: {answers[1][2]} prompt tokens, OasisKV at budget 1024 answers as stock ({answers[1][0]!r})",
              answers[0] == answers[1], f"stock {answers[0]!r}\n     oasis {answers[1]!r}")
        return failures

    covering = ["--oasis-budget", "4096"]
    setups = (
        ("plain", ["-c", "4096"], False),
        ("prompt lookup", ["-c", "4096", "--spec-type", "ngram-simple", "--spec-draft-n-max", "8"], True),
        ("draft model", ["-c", "4096", "-md", o.model, "--spec-type", "draft-simple", "--spec-draft-n-max", "4"],
         True),
    )
    for name, args, spec in setups:
        with Server(o.server, o.model, args, o.threads, "stock") as a, \
                Server(o.server, o.model, args + covering, o.threads, "oasis") as b:
            compare_setup(a, b, f"server, {name}", spec, o, args)
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
