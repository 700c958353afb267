#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Independent numpy reference for the mini-decoder's SmolLM2 prefill logits.

Reads SmolLM2-135M-Instruct.Q4_1.gguf with the `gguf` package (which dequantizes Q4_1 and
Q8_0 itself), runs the Llama forward pass in float32 numpy over fixed token ids, and writes the
last position's logits for a set of token ids (the reference's top 32 plus 32 fixed ids) to
tests/mini_decoder/smollm2_reference.txt, which test_mini_decoder checks to 1e-3 relative.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install gguf numpy
    /tmp/venv/bin/python tools/smollm2_reference.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        > tests/mini_decoder/smollm2_reference.txt

The token ids are those of the prompt below under the model's ChatML template; the C++ test
checks that its tokenizer produces the same ids (a regression check of the tokenizer).
Keys and values are rounded to float16 as the OasisKV cache stores them.
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPT = "What is the capital of France?"
# ChatML-wrapped PROMPT, tokenized by the mini-decoder's BPE tokenizer.
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
          411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
          2, 198, 1, 520, 9531, 198]


def main(path):
    r = GGUFReader(path)
    meta = {f.name: f for f in r.fields.values()}

    def scalar(key):
        f = meta[key]
        return f.parts[f.data[0]][0].item()

    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        w[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a
    n_layers = scalar("llama.block_count")
    n_heads = scalar("llama.attention.head_count")
    n_kv = scalar("llama.attention.head_count_kv")
    theta = scalar("llama.rope.freq_base")
    eps = scalar("llama.attention.layer_norm_rms_epsilon")
    emb = w["token_embd.weight"]
    dim = emb.shape[1]
    hd = dim // n_heads
    group = n_heads // n_kv

    def rmsnorm(x, g):
        return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)) * g

    n = len(TOKENS)
    pos = np.arange(n, dtype=np.float32)[:, None]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = pos * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):  # x: [n, heads, hd]; adjacent pairs rotate (GGUF's q/k are permuted for this)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos[:, None, :] - x1 * sin[:, None, :]
        out[..., 1::2] = x0 * sin[:, None, :] + x1 * cos[:, None, :]
        return out

    x = emb[TOKENS]
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for l in range(n_layers):
        p = f"blk.{l}."
        h = rmsnorm(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(n, n_heads, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(n, n_kv, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, n_kv, hd)
        k = k.astype(np.float16).astype(np.float32)
        v = v.astype(np.float16).astype(np.float32)
        att = np.empty((n, n_heads, hd), dtype=np.float32)
        for hh in range(n_heads):
            s = q[:, hh, :] @ k[:, hh // group, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            att[:, hh, :] = s @ v[:, hh // group, :]
        x = x + att.reshape(n, dim) @ w[p + "attn_output.weight"].T
        h = rmsnorm(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        u = h @ w[p + "ffn_up.weight"].T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "ffn_down.weight"].T
    out = w["output.weight"] if "output.weight" in w else emb
    logits = rmsnorm(x[-1], w["output_norm.weight"]) @ out.T
    top = np.argsort(-logits)[:32]
    fixed = np.arange(0, logits.shape[0], logits.shape[0] // 32)[:32]
    print(f"# tools/smollm2_reference.py {path.split('/')[-1]}: last-position logits, numpy float32")
    print("prompt " + PROMPT)
    print("tokens " + " ".join(map(str, TOKENS)))
    for i in list(top) + [int(f) for f in fixed if f not in top]:
        print(f"logit {int(i)} {float(logits[i]):.6f}")


if __name__ == "__main__":
    main(sys.argv[1])
