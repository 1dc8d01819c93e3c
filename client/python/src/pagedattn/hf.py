"""Hugging Face transformers models with their attention and KV cache in pagedattn.

Two pieces plug into transformers' own extension points:
  * `paged_attention_forward`, registered with `AttentionInterface` (register()) and picked by
    `model.set_attn_implementation("pagedattn")`: each layer's call sends that layer's q and the
    step's new (post-RoPE) k/v as one Forward; the server appends k/v and returns the output.
    The Forwards go over a Step stream (one step per model call, its spans sent once, with the
    first layer), or with `step_stream=False` as unary Forward RPCs.
  * `PagedAttnCache`, a transformers `Cache` that keeps no tensors: the K/V live in the server.
    It holds the sequence ids and lengths, and the plan of the step in progress (which rows of
    the padded [batch, time] input are real tokens).

`greedy_generate()` drives a causal LM step by step (ragged, left-padded prefill, then one token
per sequence per step) with either this pair or transformers' own DynamicCache + attention, so
the two can be compared token for token. Needs torch and transformers (4.5x or 5.x).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache

from .client import Cache as CacheHandle
from .client import Step
from .types import CacheConfig, LayerAttention, Span

ATTN_IMPLEMENTATION = "pagedattn"
CACHE_KWARG = "pagedattn_cache"  # the model-call kwarg transformers hands on to the attention
# The `layer_types` a cache can serve. Others (Llama 4's "chunked_attention", the linear or
# recurrent layers of hybrid models) are refused: their masks or state live in transformers.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(model_config: Any) -> None:
    """Raises ValueError when the model has layers a pagedattn cache cannot serve: a
    `layer_types` entry other than full or sliding-window attention, chunked attention, ALiBi
    biases, or multi-head latent attention (keys and values of other widths)."""
    name = getattr(model_config, "model_type", None) or "this model"
    if getattr(model_config, "alibi", False):
        raise ValueError(
            f"{name}: ALiBi position biases (alibi=True) cannot be served: a pagedattn cache "
            "attends without biases (rotary models work)")
    if getattr(model_config, "qk_nope_head_dim", None) is not None:  # DeepSeek V2/V3, MiniCPM3
        qk = model_config.qk_nope_head_dim + (getattr(model_config, "qk_rope_head_dim", 0) or 0)
        raise ValueError(
            f"{name}: multi-head latent attention (query/key heads of {qk}, value heads of "
            f"{getattr(model_config, 'v_head_dim', '?')}) cannot be served: a pagedattn cache "
            "holds keys and values of one head_dim")
    types = getattr(model_config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES})
    if other:
        layers = [i for i, t in enumerate(types) if t not in SUPPORTED_LAYER_TYPES]
        raise ValueError(
            f"{getattr(model_config, 'model_type', 'this model')}: layer_types {other} (layers "
            f"{layers[:8]}{' ...' if len(layers) > 8 else ''}) cannot be served: a pagedattn "
            f"cache serves {' and '.join(SUPPORTED_LAYER_TYPES)} layers")
    if getattr(model_config, "attention_chunk_size", None) and not types:
        raise ValueError(
            f"{getattr(model_config, 'model_type', 'this model')}: chunked attention "
            f"(attention_chunk_size={model_config.attention_chunk_size}) cannot be served: a "
            "pagedattn cache serves full and sliding-window attention")


def config_window(model_config: Any, layer: int) -> Optional[int]:
    """The sliding window layer `layer` of a transformers model config attends with (its mask's),
    or None: the config's sliding_window on the layers `layer_types` marks "sliding_attention",
    on every layer when it has a window and no layer types (Mistral), none where the config says
    it does not use its window (Qwen2's use_sliding_window=False)."""
    window = getattr(model_config, "sliding_window", None)
    if not window or not getattr(model_config, "use_sliding_window", True):
        return None
    types = getattr(model_config, "layer_types", None)
    return window if types is None or types[layer] == "sliding_attention" else None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Registers paged_attention_forward with transformers' AttentionInterface as `name`."""
    AttentionInterface.register(name, paged_attention_forward)
    return name


def set_attention(model: Any, name: str) -> None:
    """Switches `model` to the attention implementation `name` ("eager", "pagedattn", ...)."""
    if hasattr(model, "set_attn_implementation"):  # transformers >= 4.56
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def cache_config_for(model_config: Any, *, page_size: int = 16, kv_dtype: Any = "bfloat16",
                     num_pages: Optional[int] = None,
                     sinks: Optional[Sequence[Sequence[float]]] = None) -> CacheConfig:
    """A pagedattn CacheConfig with the layers, heads and per-layer attention of a transformers
    model config: a sliding window on the layers `layer_types` marks "sliding_attention" (on
    every layer when the config has a window and no layer types, as Mistral's), Gemma 2's
    `attn_logit_softcapping`, and sinks (learned weights, not config: `sinks_of(model)`, one
    sequence per layer). The attention function checks each layer's call against it. kv_dtype
    is the cache's storage, bfloat16 unless given (a float32 model loses a little precision in
    it: pass "float32" on the CPU backend to match transformers exactly). Raises ValueError for a
    model whose layers it cannot describe (check_layer_types)."""
    check_layer_types(model_config)
    head_dim = getattr(model_config, "head_dim", None) or (
        model_config.hidden_size // model_config.num_attention_heads
    )
    num_layers = model_config.num_hidden_layers
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    layers = tuple(
        LayerAttention(
            sliding_window=config_window(model_config, i),
            logit_softcap=float(softcap) if softcap else None,
            sinks=tuple(float(x) for x in sinks[i]) if sinks is not None else (),
        )
        for i in range(num_layers)
    )
    if all(layer == LayerAttention() for layer in layers):
        layers = ()
    return CacheConfig(
        num_layers=model_config.num_hidden_layers,
        num_q_heads=model_config.num_attention_heads,
        num_kv_heads=getattr(model_config, "num_key_value_heads", None)
        or model_config.num_attention_heads,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=kv_dtype,
        num_pages=num_pages,
        layers=layers,
    )


def sinks_of(model: Any) -> Optional[list[list[float]]]:
    """Each decoder layer's attention sinks (gpt-oss: `self_attn.sinks`, one logit per q head),
    for cache_config_for(..., sinks=); None when the model has none."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    found = [getattr(getattr(layer, "self_attn", None), "sinks", None) for layer in layers]
    if all(x is None for x in found):
        return None
    return [[] if x is None else x.detach().float().cpu().tolist() for x in found]


def _same(a: Optional[float], b: Optional[float]) -> bool:
    """Two optional options alike (0 and None both none; floats to float32's precision)."""
    if not a or not b:
        return not a and not b
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _layer_of(config: Any, layer: int) -> LayerAttention:
    """Layer `layer`'s options in a cache's config (CacheConfig.layers: none, one, or one each)."""
    layers = config.layers
    if len(layers) == 0:
        return LayerAttention()
    return LayerAttention.from_proto(layers[layer if len(layers) > 1 else 0])


class PagedAttnCache(Cache):
    """A transformers Cache whose K/V live in a pagedattn cache.

    Args:
        cache: the pagedattn Cache handle (client.create_cache(...)).
        seq_ids: one server sequence id per batch row.
        step_stream: send the Forwards over a Step stream, each model call a step on it (its
            spans sent with its first layer only); False: one unary Forward RPC per layer.

    Before each model call, plan(real) says which positions of the [batch, time] input are real
    tokens (False: padding); the model call must also get `pagedattn_cache=<this cache>`
    (greedy_generate does both). update() stores nothing and returns the new k/v, which the
    attention function sends to the server with q.

    The Step stream is opened by the first layer sent and kept for the steps after it; it is
    replaced by a new one when half of the client's deadline (which covers a whole stream) has
    passed, and closed by close_stream() (greedy_generate's end, release()). So one model call
    (every layer of a step) must end within half the client's timeout (Client(timeout=...)).
    A ShardedCache takes step_stream=False.

    transformers' generate() cannot drive it (it refuses the pagedattn_cache argument), nor can
    the cache be cropped or reordered (beam search, assisted decoding): those raise
    NotImplementedError.
    """

    is_compileable = False

    def __init__(self, cache: CacheHandle, seq_ids: Sequence[int], *,
                 step_stream: bool = True) -> None:
        try:  # transformers >= 4.56: a Cache is a list of layers (none here)
            super().__init__(layers=[])
        except TypeError:
            super().__init__()
        self.handle = cache
        self.seq_ids = [int(s) for s in seq_ids]
        self.lengths = [0] * len(self.seq_ids)  # tokens per sequence held by the server
        self.real: Optional[torch.Tensor] = None  # [batch, time] bool of the step in progress
        self.spans: list[Span] = []
        self._past_steps = 0  # padded time steps before the one in progress
        self._steps = 0
        self.step_stream = step_stream
        self._stream: Optional[Step] = None
        self._stream_opened = 0.0  # time.monotonic() of its opening
        self._step_options: Optional[tuple] = None  # of the step open on it; None: none open
        self.forward_calls = 0  # layers sent (unary Forwards or Step stream messages)
        self.step_streams = 0  # Step streams opened
        self._checked_layers: set[int] = set()  # layers whose attention matched the cache's
        self._sent_layers: set[int] = set()  # layers sent for the step planned last
        if step_stream and not hasattr(cache, "step"):
            raise ValueError(f"a {type(cache).__name__} has no Step stream: pass step_stream=False")

    def check_layer(self, layer: int, sliding_window: Optional[int], softcap: Optional[float],
                    sinks: Optional[torch.Tensor]) -> None:
        """Raises ValueError when the layer's attention (what transformers passes the attention
        function) differs from what the server's cache runs for it; checked once per layer."""
        if layer in self._checked_layers:
            return
        have = _layer_of(self.handle.config, layer)
        want_sinks = () if sinks is None else tuple(sinks.detach().float().cpu().tolist())
        same = (
            (have.sliding_window or None) == (sliding_window or None)
            and _same(have.logit_softcap, softcap)
            and len(have.sinks) == len(want_sinks)
            and all(_same(a, b) for a, b in zip(have.sinks, want_sinks))
        )
        if not same:
            raise ValueError(
                f"layer {layer}: the model attends with sliding_window={sliding_window}, "
                f"softcap={softcap}, sinks={'none' if sinks is None else len(want_sinks)} but the "
                f"cache runs {have}; create it with hf.cache_config_for(model.config, "
                f"sinks=hf.sinks_of(model))")
        self._checked_layers.add(layer)

    def plan(self, real: torch.Tensor) -> None:
        """Starts a step: real[b, t] is True where input row b has a token at time t. Row b's
        real tokens become positions lengths[b] .. lengths[b]+count-1 of sequence seq_ids[b]."""
        if real.dim() != 2 or real.shape[0] != len(self.seq_ids):
            raise ValueError(f"plan() needs a [batch={len(self.seq_ids)}, time] mask (got {tuple(real.shape)})")
        self.real = real.to(torch.bool)
        counts = self.real.sum(dim=1).tolist()
        self.spans = [
            Span.prefill(seq, n, start=length)
            for seq, n, length in zip(self.seq_ids, counts, self.lengths)
            if n > 0
        ]
        self.lengths = [length + n for length, n in zip(self.lengths, counts)]
        self._past_steps = self._steps
        self._steps += real.shape[1]
        self._step_options = None  # the next layer opens this step on the stream
        self._sent_layers = set()
        timeout = getattr(self.handle.client, "timeout", None)
        if self._stream is not None and timeout is not None and (
                time.monotonic() - self._stream_opened > timeout / 2):
            self.close_stream()  # before its deadline: the next layer opens another

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # Nothing is kept here: the attention function sends these new k/v to the server.
        return key_states, value_states

    def stream(self, causal: bool, sm_scale: Optional[float]) -> Step:
        """The Step stream with this step open on it (opened with this step's spans and these
        options by the step's first layer; a layer with other options opens it again)."""
        options = (causal, sm_scale)
        if self._stream is None:
            self._stream = self.handle.step(self.spans, causal=causal, sm_scale=sm_scale)
            self._stream_opened = time.monotonic()
            self.step_streams += 1
        elif options != self._step_options:
            self._stream.begin(self.spans, causal=causal, sm_scale=sm_scale)
        self._step_options = options
        return self._stream

    def close_stream(self, cancel: bool = False) -> None:
        """Closes the Step stream, if one is open (cancels it with cancel=True: after a model
        call that raised). The next layer sent opens a new one."""
        stream, self._stream = self._stream, None
        self._step_options = None
        if stream is not None:
            if cancel:
                stream.cancel()
            else:
                stream.close()

    def release(self) -> Any:
        """Frees the sequences' pages in the server and starts the cache over (empty, ready for
        another greedy_generate); returns the ReleaseSequencesResponse."""
        self.close_stream()
        resp = self.handle.release(self.seq_ids)
        self.lengths = [0] * len(self.seq_ids)
        self.real, self.spans = None, []
        self._sent_layers = set()
        self._past_steps = self._steps = 0
        return resp

    def reset(self) -> None:
        """transformers' name for starting over: release()."""
        self.release()

    def _unsupported(self, what: str) -> None:
        raise NotImplementedError(
            f"PagedAttnCache.{what}: its K/V live in the pagedattn server, by sequence; beam search, "
            "assisted decoding and cropping (transformers' generate() modes that reorder or cut a "
            "cache) are not supported: decode with greedy_generate() or your own loop of plan() "
            "and model calls (Cache.truncate() rewinds a sequence in the server)")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("crop()")

    def reorder_cache(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("reorder_cache()")

    def batch_repeat_interleave(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("batch_repeat_interleave()")

    def batch_select_indices(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("batch_select_indices()")

    @property
    def num_tokens(self) -> int:
        """Tokens of these sequences once the step planned last has run on every layer (0 for a
        new or released cache). A step that failed counts too, though the server may hold it
        on some layers only: such a cache is to be released before reuse."""
        return sum(self.lengths)

    # The padded [batch, time] view that transformers' mask code may ask about.
    def get_seq_length(self, layer_idx: Optional[int] = 0, *args: Any, **kwargs: Any) -> int:
        return self._past_steps

    def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
        return -1

    def get_max_length(self, *args: Any, **kwargs: Any) -> int:
        return -1

    def get_mask_sizes(self, query: Any = 0, *args: Any, **kwargs: Any) -> tuple[int, int]:
        # transformers 5.x passes the query length, 4.5x the cache_position tensor.
        query_length = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
        return self._past_steps + query_length, 0

    def get_query_offset(self, *args: Any, **kwargs: Any) -> int:
        return self._past_steps


def paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [batch, q_heads, time, head_dim], key/value
    [batch, kv_heads, time, head_dim] (this step's new tokens, post-RoPE). The real rows go to
    the server as one Forward on layer module.layer_idx; returns [batch, time, q_heads, head_dim]
    (zeros at padding) and no attention weights. The mask is not needed: each sequence is its
    own span, causal in the server."""
    cache = kwargs.get(CACHE_KWARG)
    if not isinstance(cache, PagedAttnCache):
        raise ValueError(
            f"the '{ATTN_IMPLEMENTATION}' attention got no {CACHE_KWARG}=<PagedAttnCache>: pass "
            "it in each model call with plan() before it, as pagedattn.hf.greedy_generate does "
            "(model.generate() cannot: it refuses arguments it does not know); where it was "
            f"passed, this model ({type(module).__name__}) does not hand the call's extra "
            "arguments on to its attention layers, and cannot run with this attention"
        )
    layer = module.layer_idx
    model_config = getattr(module, "config", None)
    if layer not in cache._checked_layers:
        check_layer_types(model_config)
        head_dim = cache.handle.config.head_dim
        if query.shape[-1] != head_dim or value.shape[-1] != head_dim:
            raise ValueError(
                f"layer {layer}: query heads of {query.shape[-1]} and value heads of "
                f"{value.shape[-1]}, but the cache's head_dim is {head_dim}")
    # A window the model keeps in its mask only (Qwen2-MoE, PhiMoE pass none): the module's,
    # else the config's for this layer.
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    elif hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = config_window(model_config, layer) if model_config is not None else None
    cache.check_layer(layer, window, kwargs.get("softcap"), kwargs.get("s_aux"))
    if dropout:
        raise NotImplementedError("pagedattn serves inference: dropout must be 0")
    real = cache.real
    if real is None or real.shape != (query.shape[0], query.shape[2]):
        raise ValueError("PagedAttnCache.plan() was not called for this step's [batch, time] input")
    if layer in cache._sent_layers:
        raise ValueError(
            f"layer {layer} was already sent for the step planned last: call plan() before each "
            "model call (sending it again would overwrite the step's tokens in the server)")
    cache._sent_layers.add(layer)
    real = real.to(query.device)
    # [batch, heads, time, dim] -> [tokens, heads, dim], rows in span order (batch-major).
    q = query.transpose(1, 2)[real]
    k = key.transpose(1, 2)[real]
    v = value.transpose(1, 2)[real]
    causal = getattr(module, "is_causal", True)
    if cache.step_stream:
        out = cache.stream(causal, scaling).forward(module.layer_idx, q, k, v)
    else:
        out = cache.handle.forward(module.layer_idx, cache.spans, q, k, v, causal=causal,
                                   sm_scale=scaling)
    cache.forward_calls += 1
    full = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    full[real] = out.to(dtype=query.dtype, device=query.device)
    return full, None


def _cache_kwarg(model: Any) -> str:
    # transformers 5.x renames past_key_values to cache (the old name is deprecated).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class Generation:
    """tokens: [batch, steps] greedy (or forced) token ids; logits: one [batch, vocab] float32
    CPU tensor per step (step 0: the prefill's last position); times in seconds."""

    tokens: torch.Tensor
    logits: list[torch.Tensor]
    chosen: torch.Tensor  # [batch, steps] the model's own argmax at each step
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@torch.no_grad()
def greedy_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    cache: Optional[PagedAttnCache] = None,
    force_tokens: Optional[torch.Tensor] = None,
    pad_token_id: int = 0,
) -> Generation:
    """Greedy decoding of a ragged batch: one left-padded prefill call, then one call per new
    token with one token per sequence.

    cache: a PagedAttnCache (the model set to the 'pagedattn' attention) or None for
    transformers' own DynamicCache with the model's current attention (e.g. eager); its Step
    stream is closed at the end (cancelled when a model call raises).
    force_tokens: [batch, max_new_tokens] tokens to feed instead of the argmax (teacher forcing,
    to compare logits step by step); `chosen` still records the argmax.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if not prompts:
        raise ValueError("prompts is empty: give one prompt (a sequence of token ids) per sequence")
    empty = [b for b, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:8]} are empty: each needs at least one token")
    if cache is not None and len(prompts) != len(cache.seq_ids):
        raise ValueError(f"{len(prompts)} prompts for a PagedAttnCache of {len(cache.seq_ids)} "
                         "sequences: one prompt per seq_id")
    device = next(model.parameters()).device
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    real = torch.zeros((batch, width), dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        real[b, width - len(p):] = True
    lengths = real.sum(dim=1)
    position_ids = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    attn_mask = real.long()

    if cache is not None and cache.num_tokens:
        raise ValueError(
            f"the PagedAttnCache holds {cache.num_tokens} tokens of an earlier generation: "
            "call its release() first (or make a new one); its sequences would go on from them "
            "while the positions start again at 0")
    kv = cache if cache is not None else DynamicCache()
    kw = {_cache_kwarg(model): kv, "use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1  # the last position's only, not [batch, time, vocab]
    if cache is not None:
        kw[CACHE_KWARG] = cache

    tokens, chosen, logits = [], [], []
    step_ids, step_pos, step_real = ids, position_ids, real
    prefill_s = decode_s = 0.0
    try:
        for step in range(max_new_tokens):
            if cache is not None:
                cache.plan(step_real)
                sent = cache.forward_calls
            t0 = time.perf_counter()
            out = model(
                input_ids=step_ids.to(device),
                attention_mask=attn_mask.to(device),
                position_ids=step_pos.to(device),
                **kw,
            )
            if cache is not None and cache.forward_calls == sent:
                impl = getattr(model.config, "_attn_implementation", None)
                cache.release()  # the step planned reached no server: the cache is as it was
                raise ValueError(
                    f"the model attended with '{impl}', not through the PagedAttnCache: nothing "
                    f"reached the server; call set_attention(model, '{ATTN_IMPLEMENTATION}') "
                    "(after register()) first")
            last = out.logits[:, -1, :].float().cpu()
            if step == 0:
                prefill_s = time.perf_counter() - t0
            else:
                decode_s += time.perf_counter() - t0
            argmax = last.argmax(dim=-1)
            nxt = argmax if force_tokens is None else force_tokens[:, step].to(torch.long)
            logits.append(last)
            chosen.append(argmax)
            tokens.append(nxt)
            step_ids = nxt[:, None]
            step_pos = lengths[:, None].clone()
            step_real = torch.ones((batch, 1), dtype=torch.bool)
            attn_mask = torch.cat([attn_mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            lengths = lengths + 1
    except BaseException:
        if cache is not None:
            cache.close_stream(cancel=True)
        raise
    if cache is not None:
        cache.close_stream()
    return Generation(
        tokens=torch.stack(tokens, dim=1),
        logits=logits,
        chosen=torch.stack(chosen, dim=1),
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_tokens=batch * (max_new_tokens - 1),
    )


def tiny_llama(*, num_layers: int = 4, num_q_heads: int = 8, num_kv_heads: int = 2,
               head_dim: int = 64, vocab_size: int = 512, seed: int = 0,
               dtype: Any = torch.float32, device: Any = "cpu") -> Any:
    """A LlamaForCausalLM with random weights from a fixed seed (nothing is downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_q_heads * head_dim,
        intermediate_size=2 * num_q_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype=dtype, device=device)
    model.eval()
    return model
