"""A real model through the service: a Llama (random weights, fixed seed, GQA 8/2 heads,
head_dim 64, 4 layers) generates 32 tokens for 3 ragged prompts with every attention call and
the whole KV cache in pagedattn, compared with the same model on transformers' own eager
attention and DynamicCache.

float32 (CPU backend): identical token ids, logits within 1e-4 relative.
bfloat16 / float16 (any backend): logits within the dtype's tolerance at every step (the
reference fed the same tokens), and the same greedy token at every step except where the
reference's own top two logits are within that noise of each other (a tie in the dtype: random
weights make a few); the free-running token ids agree up to the first such tie.
After release every page is back. Both transports: the layers of each model call over one Step
stream (the default), and one unary Forward per layer. Skipped with the reason when torch or
transformers is missing.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch", reason="the model test needs torch")
pytest.importorskip("transformers", reason="the model test needs transformers")

import pagedattn  # noqa: E402
from pagedattn import hf  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [7, 7, 7] + list(range(100, 114))]  # 5, 11, 17
NEW_TOKENS = 32
# Relative error of the logits (||got - ref|| / ||ref|| per step) allowed per model dtype.
# float8_e4m3: a float32 model on an FP8 cache (3 mantissa bits: 3.3% at worst over the 32 steps
# on a CPU server).
LOGITS_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2, "float8_e4m3": 8e-2}


def _device() -> str:
    return os.environ.get("PAGEDATTN_MODEL_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("step_stream", [True, False], ids=["step", "forward"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_generation_matches_transformers(client, kv_dtypes, backend, dtype, step_stream):
    if dtype not in kv_dtypes:
        pytest.skip(f"the {backend} backend has no {dtype} cache")
    device = _device()
    model = hf.tiny_llama(dtype=getattr(torch, dtype), device=device)
    hf.register()

    hf.set_attention(model, "pagedattn")
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype=dtype, num_pages=16)
    with client.create_cache(config, "test_model") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13], step_stream=step_stream)
        got = hf.greedy_generate(model, PROMPTS, NEW_TOKENS, cache=paged_cache)
        # One Forward per layer per step: a prefill and 31 decode steps, 4 layers; with
        # step_stream, all of them on one Step stream (a step on it per model call).
        assert paged_cache.forward_calls == NEW_TOKENS * model.config.num_hidden_layers
        assert paged_cache.step_streams == (1 if step_stream else 0)
        stats = cache.stats()
        assert stats.forward_calls == paged_cache.forward_calls
        lengths = [len(p) + NEW_TOKENS - 1 for p in PROMPTS]  # the last token is never fed back
        assert stats.live_sequences == 3
        assert stats.used_pages == sum(-(-n // 16) for n in lengths)
        released = paged_cache.release()
        assert (released.released, released.freed_pages) == (3, stats.used_pages)
        after = cache.stats()
        assert (after.used_pages, after.free_pages, after.live_sequences) == (0, 16, 0)

    _expect_same_generation(model, got, dtype, f"{backend}/{device}")


def _expect_same_generation(model, got, dtype, where):
    """got (through pagedattn) against the model on transformers' eager attention: free-running,
    and fed got's tokens (teacher forcing) to compare the logits step by step."""
    hf.set_attention(model, "eager")
    ref = hf.greedy_generate(model, PROMPTS, NEW_TOKENS)
    forced = hf.greedy_generate(model, PROMPTS, NEW_TOKENS, force_tokens=got.tokens)

    worst, ties = 0.0, []
    first_tie = [NEW_TOKENS] * len(PROMPTS)
    for step, (g, r) in enumerate(zip(got.logits, forced.logits)):
        err = ((g - r).norm() / r.norm()).item()
        worst = max(worst, err)
        noise = (g - r).abs().max(dim=1).values  # per row, this step
        for b in range(len(PROMPTS)):
            mine, theirs = got.tokens[b, step].item(), forced.chosen[b, step].item()
            if mine != theirs:
                margin = (r[b, theirs] - r[b, mine]).item()
                assert dtype != "float32", f"row {b} step {step}: token {mine} != reference {theirs}"
                assert margin <= 2 * noise[b].item(), (
                    f"row {b} step {step}: token {mine} != reference {theirs} with a margin of "
                    f"{margin:.4g} > twice the logits noise {noise[b].item():.4g}")
                ties.append((b, step, margin))
                first_tie[b] = min(first_tie[b], step)
    print(f"\n{dtype} on {where}: max relative logits error {worst:.3g} over "
          f"{NEW_TOKENS} steps; {len(ties)} tie decisions {ties}; decode "
          f"{got.decode_tokens_per_s:.1f} tokens/s through pagedattn, "
          f"{ref.decode_tokens_per_s:.1f} tokens/s eager")
    assert worst <= LOGITS_TOLERANCE[dtype], f"logits relative error {worst:.3g}"
    for b in range(len(PROMPTS)):
        n = first_tie[b]
        assert torch.equal(got.tokens[b, :n], ref.tokens[b, :n]), (
            f"row {b}: free-running tokens differ before the first tie (step {n})")
    if dtype == "float32":
        assert torch.equal(got.tokens, ref.tokens)


def _tiny(kind, dtype, device):
    """Models with per-layer attention options, random weights from a fixed seed: Gemma 2
    (windowed and global layers alternating, every score soft-capped: a small cap and window so
    that both change the answer), gpt-oss (the same alternation, with sinks), Mistral (every
    layer windowed, no layer types) and Qwen2-MoE (alternating too, its window in transformers'
    mask only: its attention layers are not passed it)."""
    import transformers

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=4,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "gemma2":
        config = transformers.Gemma2Config(attn_logit_softcapping=2.0, **common)
        model = transformers.Gemma2ForCausalLM(config)
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            use_sliding_window=True, layer_types=["sliding_attention", "full_attention"] * 2,
            num_experts=2, num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        # Every expert on every token: top-k routing would turn the dtype's noise into a
        # different expert (a jump in the logits) wherever two experts' scores are close.
        config = transformers.GptOssConfig(num_local_experts=2, num_experts_per_tok=2, **common)
        model = transformers.GptOssForCausalLM(config)
        for layer in model.model.layers:  # sinks large enough to take a share of each row
            layer.self_attn.sinks.data = 2.0 * torch.randn_like(layer.self_attn.sinks)
    return model.to(dtype=dtype, device=device).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "mistral", "qwen2_moe"])
def test_models_with_layer_options_match_transformers(client, kv_dtypes, backend, kind, dtype):
    """Gemma 2, gpt-oss, Mistral and Qwen2-MoE through pagedattn: the cache made from the model
    (cache_config_for with sinks_of) carries each layer's window, soft-cap and sinks; the
    generation matches transformers' eager attention as above."""
    if dtype not in kv_dtypes:
        pytest.skip(f"the {backend} backend has no {dtype} cache")
    device = _device()
    model = _tiny(kind, getattr(torch, dtype), device)
    hf.register()
    hf.set_attention(model, "pagedattn")
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype=dtype, num_pages=16,
                                 sinks=hf.sinks_of(model))
    windows = [layer.sliding_window for layer in config.layers]
    assert windows == ([4] * 4 if kind == "mistral" else [4, None, 4, None])
    assert all((layer.logit_softcap == 2.0) == (kind == "gemma2") for layer in config.layers)
    assert all(bool(layer.sinks) == (kind == "gpt_oss") for layer in config.layers)
    with client.create_cache(config, f"test_model_{kind}") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        got = hf.greedy_generate(model, PROMPTS, NEW_TOKENS, cache=paged_cache)
    _expect_same_generation(model, got, dtype, f"{kind} on {backend}/{device}")


def test_a_cache_without_the_models_options_is_refused(client, kv_dtypes):
    """A Gemma 2 model on a plain cache: the attention function names the layer and what
    differs instead of attending without its window and cap."""
    dtype = "float32" if "float32" in kv_dtypes else "bfloat16"
    model = _tiny("gemma2", getattr(torch, dtype), _device())
    hf.register()
    hf.set_attention(model, "pagedattn")
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype=dtype, num_pages=16)
    plain = dataclasses.replace(config, layers=())
    with client.create_cache(plain, "test_model_plain") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        with pytest.raises(ValueError, match=r"layer 0: .*sliding_window=4, softcap=2.0"):
            hf.greedy_generate(model, PROMPTS, 2, cache=paged_cache)
    # A window kept in the mask only (Qwen2-MoE): a plain cache would attend without it.
    model = _tiny("qwen2_moe", getattr(torch, dtype), _device())
    hf.set_attention(model, "pagedattn")
    with client.create_cache(plain, "test_model_plain_moe") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        with pytest.raises(ValueError, match=r"layer 0: .*sliding_window=4, softcap=None"):
            hf.greedy_generate(model, PROMPTS, 2, cache=paged_cache)


def test_fp8_cache_generation_tracks_transformers(client, kv_dtypes, backend):
    """The float32 Llama on an FP8 cache (PER_TOKEN scales): half the bytes of a bfloat16 cache,
    logits within LOGITS_TOLERANCE["float8_e4m3"] of eager attention at every step (fed the same
    tokens), and the same greedy token except at ties within that noise."""
    if "float8_e4m3" not in kv_dtypes:
        pytest.skip(f"the {backend} backend has no float8_e4m3 cache")
    device = _device()
    model = hf.tiny_llama(dtype=torch.float32, device=device)
    hf.register()
    hf.set_attention(model, "pagedattn")
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype="float8_e4m3", num_pages=16)
    with client.create_cache(config, "test_model_fp8") as cache:
        # 2 (K, V) x 4 layers x 2 kv heads x (64 one-byte values + a 4-byte scale).
        assert cache.info.bytes_per_token == 2 * 4 * 2 * (64 + 4)
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        got = hf.greedy_generate(model, PROMPTS, NEW_TOKENS, cache=paged_cache)
    _expect_same_generation(model, got, "float8_e4m3", f"fp8 cache on {backend}/{device}")


def _tiny_head_dim(kind, dtype, device):
    """Model families whose head dims are not 64 or 128, random weights from a fixed seed:
    Phi-3 (96), GPT-NeoX / Pythia (80), and Llamas with wide heads (192, 512)."""
    import transformers

    small = dict(vocab_size=512, intermediate_size=512, num_hidden_layers=2,
                 max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            hidden_size=192, num_attention_heads=2, num_key_value_heads=1, **small))
    elif kind == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            hidden_size=160, num_attention_heads=2, **small))
    else:
        head_dim = int(kind.split("_")[1])
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
            **small))
    return model.to(dtype=dtype, device=device).eval()


@pytest.mark.parametrize("kind,head_dim", [("phi3", 96), ("gpt_neox", 80), ("llama_192", 192),
                                           ("llama_512", 512)])
def test_model_families_of_other_head_dims(client, server_info, kv_dtypes, backend, kind,
                                           head_dim):
    """Phi-3, GPT-NeoX and wide-head Llamas through pagedattn: the cache takes the model's
    head_dim (where the backend serves it: GetServerInfo's table) and the generation matches
    transformers' eager attention as above."""
    if head_dim not in server_info.capabilities.head_dims:
        pytest.skip(f"the {backend} backend has no head_dim {head_dim}")
    dtype = "float32" if "float32" in kv_dtypes else "bfloat16"
    device = _device()
    model = _tiny_head_dim(kind, getattr(torch, dtype), device)
    hf.register()
    hf.set_attention(model, "pagedattn")
    # sinks_of is the recipe for any model: None where there are none (GPT-NeoX's layers have
    # `attention`, not `self_attn`).
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype=dtype, num_pages=16,
                                 sinks=hf.sinks_of(model))
    assert config.head_dim == head_dim
    with client.create_cache(config, f"test_model_{kind}") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        got = hf.greedy_generate(model, PROMPTS, NEW_TOKENS, cache=paged_cache)
        # Every layer's attention of every step went through the service.
        assert paged_cache.forward_calls == NEW_TOKENS * model.config.num_hidden_layers
    _expect_same_generation(model, got, dtype, f"{kind} on {backend}/{device}")


def test_layers_a_cache_cannot_serve_are_refused():
    """Llama 4's chunked attention lives in transformers' mask, which the attention function
    does not use; hybrid models' linear layers keep state there: refused by name, not served
    wrongly."""
    from types import SimpleNamespace

    base = dict(model_type="llama4_text", num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, hidden_size=256, head_dim=64)
    chunked = SimpleNamespace(**base, layer_types=["chunked_attention"] * 3 + ["full_attention"])
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] \(layers \[0, 1, 2\]\)"):
        hf.cache_config_for(chunked)
    with pytest.raises(ValueError, match="chunked attention .attention_chunk_size=8192."):
        hf.cache_config_for(SimpleNamespace(**base, attention_chunk_size=8192))
    hybrid = SimpleNamespace(**dict(base, model_type="qwen3_next"),
                             layer_types=["linear_attention", "full_attention"] * 2)
    with pytest.raises(ValueError, match=r"qwen3_next: layer_types \['linear_attention'\]"):
        hf.cache_config_for(hybrid)
    mla = SimpleNamespace(**dict(base, model_type="deepseek_v3"), qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128)
    with pytest.raises(ValueError, match=r"deepseek_v3: multi-head latent attention \(query/key "
                                         r"heads of 192, value heads of 128\)"):
        hf.cache_config_for(mla)
    with pytest.raises(ValueError, match=r"falcon: ALiBi"):
        hf.cache_config_for(SimpleNamespace(**dict(base, model_type="falcon"), alibi=True))
    ok = SimpleNamespace(**base, layer_types=["sliding_attention", "full_attention"] * 2,
                         sliding_window=8)
    assert [layer.sliding_window for layer in hf.cache_config_for(ok).layers] == [8, None, 8, None]


def test_a_used_cache_is_refused_until_released(client, kv_dtypes):
    """A second greedy_generate on the same PagedAttnCache would append to the first run's
    sequences while its positions start at 0: refused; after release() it runs as the first."""
    dtype = "float32" if "float32" in kv_dtypes else "bfloat16"
    model = hf.tiny_llama(dtype=getattr(torch, dtype), device=_device())
    hf.register()
    hf.set_attention(model, "pagedattn")
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype=dtype, num_pages=16)
    with client.create_cache(config, "test_model_reuse") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        first = hf.greedy_generate(model, PROMPTS, 4, cache=paged_cache)
        assert paged_cache.num_tokens == sum(len(p) + 3 for p in PROMPTS)
        with pytest.raises(ValueError, match=r"holds 42 tokens of an earlier generation"):
            hf.greedy_generate(model, PROMPTS, 4, cache=paged_cache)
        paged_cache.release()
        assert paged_cache.num_tokens == 0 and paged_cache.get_seq_length() == 0
        again = hf.greedy_generate(model, PROMPTS, 4, cache=paged_cache)
    assert torch.equal(again.tokens, first.tokens)
    for a, b in zip(again.logits, first.logits):
        assert torch.equal(a, b)


def test_misuse_is_refused_by_name(client, kv_dtypes):
    """What transformers' Cache API or a caller's own loop may ask of a PagedAttnCache that it
    cannot do is refused by name, not done silently wrong: cropping or reordering (beam search),
    a model left on another attention (nothing reached the server), a step sent twice without
    plan() (it would overwrite the step's tokens), prompts that do not fit the cache's
    sequences; reset() is release()."""
    dtype = "float32" if "float32" in kv_dtypes else "bfloat16"
    model = hf.tiny_llama(num_layers=2, dtype=getattr(torch, dtype), device=_device())
    hf.register()
    config = hf.cache_config_for(model.config, page_size=16, kv_dtype=dtype, num_pages=16)
    with client.create_cache(config, "test_model_misuse") as cache:
        paged_cache = hf.PagedAttnCache(cache, seq_ids=[11, 12, 13])
        hf.set_attention(model, "eager")
        with pytest.raises(ValueError, match=r"attended with 'eager'.*set_attention\(model, 'pagedattn'\)"):
            hf.greedy_generate(model, PROMPTS, 1, cache=paged_cache)
        assert paged_cache.num_tokens == 0  # ready as it was, no release() needed
        hf.set_attention(model, "pagedattn")
        hf.greedy_generate(model, PROMPTS, 2, cache=paged_cache)
        for method, args in [("crop", (3,)), ("reorder_cache", (torch.tensor([2, 1, 0]),)),
                             ("batch_select_indices", (torch.tensor([0]),)),
                             ("batch_repeat_interleave", (2,))]:
            with pytest.raises(NotImplementedError, match=rf"PagedAttnCache.{method}\(\).*beam search"):
                getattr(paged_cache, method)(*args)
        # The step planned last sent again: refused before anything is sent.
        calls = cache.stats().forward_calls
        step_ids = torch.tensor([[1], [2], [3]])
        with pytest.raises(ValueError, match=r"layer 0 was already sent for the step planned last"):
            model(input_ids=step_ids, pagedattn_cache=paged_cache, use_cache=True,
                  **{hf._cache_kwarg(model): paged_cache})
        assert cache.stats().forward_calls == calls
        paged_cache.reset()
        assert paged_cache.num_tokens == 0 and cache.stats().used_pages == 0
        with pytest.raises(ValueError, match=r"2 prompts for a PagedAttnCache of 3 sequences"):
            hf.greedy_generate(model, PROMPTS[:2], 2, cache=paged_cache)
        with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
            hf.greedy_generate(model, [PROMPTS[0], [], PROMPTS[2]], 2, cache=paged_cache)
        with pytest.raises(ValueError, match=r"max_new_tokens must be at least 1 \(got 0\)"):
            hf.greedy_generate(model, PROMPTS, 0, cache=paged_cache)
        assert cache.stats().used_pages == 0
