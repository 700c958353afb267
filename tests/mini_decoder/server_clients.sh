#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `mini_decoder serve` through real clients: starts the server on a free loopback port with the
# given model (stories260K), then checks curl (whole and streamed) and the openai Python package
# (completions and chat completions, whole and streamed, a 400 as BadRequestError) against the
# CLI's own greedy answer, and that SIGTERM stops the server with exit code 0.
#   usage: server_clients.sh <mini_decoder binary> <model file>
# The openai package comes from $OASISKV_PYTHON, else build/venv (scripts/test.sh installs it
# there), else python3; the test fails when none has it.
set -euo pipefail

md=${1:?usage: server_clients.sh <mini_decoder binary> <model file>}
model=${2:?usage: server_clients.sh <mini_decoder binary> <model file>}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${OASISKV_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x "$repo/build/venv/bin/python3" ]; then
    python=$repo/build/venv/bin/python3
  else
    python=python3
  fi
fi
if ! "$python" -c 'import openai' 2>/dev/null; then
  echo "error: the openai Python package is missing for $python; install it with:" >&2
  echo "  python3 -m venv $repo/build/venv && $repo/build/venv/bin/pip install openai" >&2
  echo "  (scripts/test.sh does this), or set OASISKV_PYTHON to a python that has it" >&2
  exit 1
fi
command -v curl >/dev/null || {
  echo "error: curl is missing: apt-get install curl" >&2
  exit 1
}
# Loopback only: no proxy between the clients and the server.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost

work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

prompt="Once upon a time"
max_tokens=24
# The CLI's greedy answer: stdout is the prompt, then the answer, then a newline.
"$md" --model "$model" --prompt "$prompt" --max-tokens "$max_tokens" >"$work/cli.txt" 2>/dev/null

"$md" serve --model "$model" --host 127.0.0.1 --port 0 --fast-tier-mib 64 --log \
  >"$work/server.log" 2>&1 &
pid=$!
port=""
for _ in $(seq 1 600); do  # at most 60 s (the sanitizer build starts slowly)
  port=$(sed -nE 's|.*listening on http://127\.0\.0\.1:([0-9]+).*|\1|p' "$work/server.log")
  [ -n "$port" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "error: the server did not start:" >&2
  cat "$work/server.log" >&2
  exit 1
fi
url=http://127.0.0.1:$port
healthy=0
for _ in $(seq 1 100); do  # at most ~10 s
  if curl -sS --noproxy '*' --max-time 2 -o "$work/health.json" "$url/health" 2>/dev/null; then
    healthy=1
    break
  fi
  sleep 0.1
done
[ "$healthy" -eq 1 ] || {
  echo "error: $url/health never answered" >&2
  exit 1
}

body() {  # body <stream: true|false>
  printf '{"model": "stories260K", "prompt": "%s", "max_tokens": %d, "temperature": 0, "stream": %s}' \
    "$prompt" "$max_tokens" "$1"
}
post() {  # post <path> <body> <output file>: prints the HTTP status
  curl -sS --noproxy '*' --max-time 120 -N -o "$3" -w '%{http_code}' -H 'Content-Type: application/json' \
    -d "$2" "$url$1"
}
status=$(post /v1/completions "$(body false)" "$work/whole.json")
[ "$status" = 200 ] || {
  echo "error: curl /v1/completions: HTTP $status: $(cat "$work/whole.json")" >&2
  exit 1
}
status=$(post /v1/completions "$(body true)" "$work/stream.sse")
[ "$status" = 200 ] || {
  echo "error: curl /v1/completions (stream): HTTP $status" >&2
  exit 1
}
status=$(post /v1/completions '{"prompt": "x", "max_tokens": 0}' "$work/bad.json")
[ "$status" = 400 ] || {
  echo "error: curl /v1/completions with max_tokens 0: HTTP $status, not 400" >&2
  exit 1
}

"$python" - "$url" "$prompt" "$max_tokens" "$work" <<'EOF'
import json, sys
import openai

url, prompt, max_tokens, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
failures = []

def check(what, got, want):
    if got != want:
        failures.append(f"{what}: got {got!r}, want {want!r}")

cli = open(f"{work}/cli.txt", encoding="utf-8").read()
assert cli.startswith(prompt) and cli.endswith("\n"), f"unexpected CLI output {cli!r}"
want = cli[len(prompt):-1]
assert want, "the CLI's answer is empty"

whole = json.load(open(f"{work}/whole.json", encoding="utf-8"))
check("curl: object", whole["object"], "text_completion")
check("curl: text", whole["choices"][0]["text"], want)
check("curl: usage.completion_tokens <= max_tokens",
      whole["usage"]["completion_tokens"] <= max_tokens, True)
events = [e for e in open(f"{work}/stream.sse", encoding="utf-8").read().split("\n\n") if e]
check("curl stream: every event is data:", all(e.startswith("data: ") for e in events), True)
check("curl stream: last event", events[-1], "data: [DONE]")
check("curl stream: text", "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]), want)
bad = json.load(open(f"{work}/bad.json", encoding="utf-8"))
check("curl 400: error.type", bad["error"]["type"], "invalid_request_error")
check("curl 400: error.param", bad["error"]["param"], "max_tokens")

client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
check("openai: models", [m.id for m in client.models.list().data], ["stories260K"])
check("openai: models.retrieve", client.models.retrieve("stories260K").id, "stories260K")
c = client.completions.create(model="stories260K", prompt=prompt, max_tokens=max_tokens,
                              temperature=0)
check("openai completions: text", c.choices[0].text, want)
check("openai completions: usage", c.usage.total_tokens,
      c.usage.prompt_tokens + c.usage.completion_tokens)
parts = client.completions.create(model="stories260K", prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, stream=True)
check("openai completions stream: text", "".join(p.choices[0].text for p in parts), want)
messages = [{"role": "user", "content": prompt}]  # llama2.c: no template, the message itself
r = client.chat.completions.create(model="stories260K", messages=messages,
                                   max_tokens=max_tokens, temperature=0)
check("openai chat: role", r.choices[0].message.role, "assistant")
check("openai chat: content", r.choices[0].message.content, want)
check("openai chat: finish_reason", r.choices[0].finish_reason in ("stop", "length"), True)
parts = client.chat.completions.create(model="stories260K", messages=messages,
                                       max_tokens=max_tokens, temperature=0, stream=True)
text, finish = "", None
for p in parts:
    if p.choices:
        text += p.choices[0].delta.content or ""
        finish = p.choices[0].finish_reason or finish
check("openai chat stream: content", text, want)
check("openai chat stream: finish_reason", finish, r.choices[0].finish_reason)
try:
    client.chat.completions.create(model="stories260K",
                                   messages=[{"role": "wizard", "content": "x"}])
    failures.append("openai: an unknown role was accepted")
except openai.BadRequestError as e:
    check("openai 400: status", e.status_code, 400)

# What the server implements beyond the basics, and what it refuses, through the client.
c = client.completions.create(model="stories260K", prompt=prompt, max_tokens=8, temperature=0,
                              logprobs=2, n=2)
check("openai n=2: choices", len(c.choices), 2)
check("openai logprobs: one per token", len(c.choices[0].logprobs.tokens),
      c.usage.completion_tokens // 2)
check("openai logprobs: top 2", all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs), True)
r = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=4,
                                   temperature=0, logprobs=True, top_logprobs=1)
check("openai chat logprobs", len(r.choices[0].logprobs.content), r.usage.completion_tokens)
try:
    client.chat.completions.create(model="stories260K", messages=messages, max_tokens=4,
                                   tools=[{"type": "function", "function": {"name": "f"}}])
    failures.append("openai: tools were accepted")
except openai.BadRequestError as e:
    check("openai tools: param", e.body.get("param") if isinstance(e.body, dict) else None, "tools")
try:
    client.completions.create(model="gpt-4o", prompt=prompt, max_tokens=4)
    failures.append("openai: another model was accepted")
except openai.NotFoundError as e:
    check("openai other model: status", e.status_code, 404)

for f in failures:
    print("error:", f, file=sys.stderr)
print(f"server_clients: {'FAILED' if failures else 'all checks passed'} (answer {want!r})")
sys.exit(1 if failures else 0)
EOF

kill -TERM "$pid"
for _ in $(seq 1 300); do  # at most 30 s
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
  echo "error: the server still runs 30 s after SIGTERM" >&2
  exit 1
fi
rc=0
wait "$pid" || rc=$?
pid=""
if [ "$rc" -ne 0 ]; then
  echo "error: the server exited with $rc after SIGTERM:" >&2
  tail -n 20 "$work/server.log" >&2
  exit 1
fi
echo "server_clients: the server stopped cleanly"
