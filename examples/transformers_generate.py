#!/usr/bin/env python3
"""A Hugging Face Llama generating text with every attention call and its whole KV cache in a
pagedattn server.

The model is a LlamaForCausalLM built from a small LlamaConfig with random weights from a fixed
seed (nothing is downloaded). A ragged batch of prompts is prefilled in one call, then decoded
greedily one token per sequence per step; each layer of each step is one Forward carrying that
layer's q and the new (post-RoPE) k/v of every sequence, all of them on one Step stream (a step
on it per model call; --unary: one unary Forward RPC per layer). Prints the generated token ids and
tokens/s; --compare also runs transformers' own eager attention + DynamicCache and compares the
tokens and logits (exit status 1 when a float32 model on a float32 cache generates other tokens;
in bfloat16 or float16, or on an FP8 cache, rounding may part greedy ways at a near tie).

    python3 examples/transformers_generate.py --target localhost:50051
    python3 examples/transformers_generate.py --target gpu-host:50051 --dtype bfloat16 --compare

Needs: pip install ./client/python torch transformers (4.5x or 5.x).
"""

from __future__ import annotations

import argparse
import sys
import time

try:
    import torch

    import pagedattn
    from pagedattn import hf
except ImportError as e:  # one line saying what to install, not a traceback
    sys.stderr.write(f"transformers_generate.py: {e}; this example needs torch and transformers: "
                     "pip install ./client/python torch transformers\n")
    sys.exit(2)


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"each prompt length must be at least 1 (got '{text}')")
    return lengths


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:50051", help="pagedattn server host:port")
    p.add_argument("--token", default=None, help="bearer token, if the server wants one")
    p.add_argument("--layers", type=_positive, default=4, help="decoder layers (default 4)")
    p.add_argument("--q-heads", type=_positive, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=_positive, default=2,
                   help="key/value heads, dividing --q-heads (default 2: GQA 4)")
    p.add_argument("--head-dim", type=int, default=64, choices=[64, 80, 96, 128, 192, 256, 512],
                   help="head size (default 64)")
    p.add_argument("--vocab", type=_positive, default=512, help="vocabulary size (default 512)")
    p.add_argument("--prompt-lengths", type=_lengths, default=[5, 11, 17],
                   help="one random prompt per length, comma-separated (a ragged batch; default "
                        "5,11,17)")
    p.add_argument("--new-tokens", type=_positive, default=32,
                   help="tokens generated per sequence (default 32)")
    p.add_argument("--page-size", type=_positive, default=16,
                   help="the cache's page size, tokens (default 16)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model and cache dtype (float32 caches: CPU backend only); auto: float32 "
                        "on a CPU server, bfloat16 on a CUDA one")
    p.add_argument("--kv-dtype", default=None,
                   help="the cache's dtype when not the model's: e.g. float8_e4m3 (an FP8 cache) "
                        "under a float32 or bfloat16 model")
    p.add_argument("--device", default="auto", help="torch device of the model (auto: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default 0)")
    p.add_argument("--unary", action="store_true",
                   help="one unary Forward RPC per layer instead of a Step stream per step")
    p.add_argument("--compare", action="store_true",
                   help="also generate with transformers' eager attention and compare the tokens")
    a = p.parse_args()

    with pagedattn.Client(a.target, a.token, timeout=600) as client:
        info = client.server_info()
        dtype = a.dtype if a.dtype != "auto" else ("float32" if info.backend == "cpu" else "bfloat16")
        device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model = hf.tiny_llama(num_layers=a.layers, num_q_heads=a.q_heads, num_kv_heads=a.kv_heads,
                              head_dim=a.head_dim, vocab_size=a.vocab, seed=a.seed,
                              dtype=getattr(torch, dtype), device=device)
        gen = torch.Generator().manual_seed(a.seed + 1)
        lengths = a.prompt_lengths
        prompts = [torch.randint(1, a.vocab, (n,), generator=gen).tolist() for n in lengths]
        longest = max(lengths) + a.new_tokens
        pages = len(prompts) * -(-longest // a.page_size)
        kv_dtype = a.kv_dtype or dtype
        config = hf.cache_config_for(model.config, page_size=a.page_size, kv_dtype=kv_dtype,
                                     num_pages=pages)
        print(f"server {a.target}: pagedattn {info.version}, backend {info.backend} "
              f"({info.device_name}); model: Llama {a.layers} layers, {a.q_heads} q / "
              f"{a.kv_heads} kv heads x {a.head_dim}, {dtype} on {device}, {kv_dtype} cache; "
              f"prompts of "
              f"{lengths} tokens, {a.new_tokens} new tokens each")

        hf.register()
        hf.set_attention(model, hf.ATTN_IMPLEMENTATION)
        with client.create_cache(config, "transformers_generate") as cache:
            kv = hf.PagedAttnCache(cache, seq_ids=range(1, len(prompts) + 1),
                                   step_stream=not a.unary)
            t0 = time.perf_counter()
            out = hf.greedy_generate(model, prompts, a.new_tokens, cache=kv)
            total = time.perf_counter() - t0
            used = cache.stats().used_pages
            freed = kv.release().freed_pages
        transport = f"on {kv.step_streams} Step stream(s)" if kv.step_streams else "as unary RPCs"
        for i, row in enumerate(out.tokens.tolist()):
            print(f"sequence {i + 1} (prompt {lengths[i]} tokens): {row}")
        print(f"prefill {out.prefill_s * 1e3:.1f} ms; decode {out.decode_tokens} tokens in "
              f"{out.decode_s:.3f} s = {out.decode_tokens_per_s:.1f} tokens/s "
              f"({kv.forward_calls} Forwards {transport}, {total:.2f} s in all); "
              f"{used} pages used, {freed} freed on release")

        if a.compare:
            hf.set_attention(model, "eager")
            ref = hf.greedy_generate(model, prompts, a.new_tokens)
            # The same model fed pagedattn's tokens: logits comparable at every step.
            forced = hf.greedy_generate(model, prompts, a.new_tokens, force_tokens=out.tokens)
            err = max(((g - r).norm() / r.norm()).item() for g, r in zip(out.logits, forced.logits))
            same = torch.equal(ref.tokens, out.tokens)
            verdict = "identical"
            if not same:
                step = int((ref.tokens != out.tokens).any(dim=0).nonzero()[0])
                verdict = f"identical up to step {step}, where greedy parts ways"
            print(f"eager transformers + DynamicCache: {ref.decode_tokens_per_s:.1f} tokens/s; "
                  f"tokens {verdict}; max relative logits error on the same tokens {err:.3g}")
            if dtype == "float32" and kv_dtype == "float32" and not same:
                return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (pagedattn.errors.PagedAttnError, ValueError) as e:  # the server's or hf's words
        sys.stderr.write(f"transformers_generate.py: {type(e).__name__}: {e}\n")
        sys.exit(1)
