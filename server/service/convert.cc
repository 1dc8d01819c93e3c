// Field-by-field mapping between proto messages and core structs.
#include "server/service/convert.h"

namespace pagedattn {

CacheConfigRequest FromProto(const v1::CacheConfig& c) {
  CacheConfigRequest r;
  r.num_layers = c.num_layers();
  r.num_q_heads = c.num_q_heads();
  r.num_kv_heads = c.num_kv_heads();
  r.head_dim = c.head_dim();
  r.page_size = c.page_size();
  r.kv_dtype = static_cast<DType>(c.kv_dtype());
  if (c.capacity_case() == v1::CacheConfig::kNumPages) r.num_pages = c.num_pages();
  if (c.capacity_case() == v1::CacheConfig::kMaxBytes) r.max_bytes = c.max_bytes();
  r.device = c.device();
  r.layers.reserve(static_cast<size_t>(c.layers_size()));  // no doubling: a hostile count is large
  for (const v1::LayerAttention& l : c.layers()) {
    LayerAttentionRequest& out = r.layers.emplace_back();
    if (l.has_sliding_window()) out.sliding_window = l.sliding_window();
    if (l.has_logit_softcap()) out.logit_softcap = l.logit_softcap();
    out.sinks.assign(l.sinks().begin(), l.sinks().end());
  }
  r.kv_scaling = static_cast<KvScaling>(c.kv_scaling());
  r.kv_scales.assign(c.kv_scales().begin(), c.kv_scales().end());
  return r;
}

void ToProto(const CacheGeometry& g, v1::CacheConfig* out) {
  out->set_num_layers(g.num_layers);
  out->set_num_q_heads(g.num_q_heads);
  out->set_num_kv_heads(g.num_kv_heads);
  out->set_head_dim(g.head_dim);
  out->set_page_size(g.page_size);
  out->set_kv_dtype(static_cast<v1::DType>(g.kv_dtype));
  out->set_num_pages(g.num_pages);
  out->set_device(g.device);
  for (const LayerAttention& l : g.layers) {  // resolved: one entry per layer, or none
    v1::LayerAttention* pl = out->add_layers();
    if (l.sliding_window > 0) pl->set_sliding_window(l.sliding_window);
    if (l.logit_softcap > 0) pl->set_logit_softcap(l.logit_softcap);
    for (float sink : l.sinks) pl->add_sinks(sink);
  }
  out->set_kv_scaling(static_cast<v1::KvScaling>(g.kv_scaling));
  for (float scale : g.kv_scales) out->add_kv_scales(scale);  // resolved: 2 per layer
}

void ToProto(const Cache& cache, v1::CacheInfo* out) {
  const CacheGeometry& g = cache.geometry();
  out->set_cache_id(cache.id());
  out->set_name(cache.name());
  ToProto(g, out->mutable_config());
  out->set_num_pages(g.num_pages);
  out->set_capacity_tokens(g.num_pages * g.page_size);
  out->set_bytes(g.TotalBytes());
  out->set_bytes_per_token(g.BytesPerPage() / g.page_size);
  const CacheStats s = cache.Stats();
  out->mutable_stats()->set_free_pages(s.free_pages);
  out->mutable_stats()->set_used_pages(s.used_pages);
  out->mutable_stats()->set_live_sequences(s.live_sequences);
  out->mutable_stats()->set_forward_calls(s.forward_calls);
  out->mutable_stats()->set_idle_ms(s.idle_ms);
  out->set_created_unix_ms(cache.created_unix_ms());
}

void ToProto(const ValidationResult& r, v1::ValidateCacheConfigResponse* out) {
  out->set_valid(r.valid() && r.fits);
  for (const FieldViolation& v : r.violations) {
    auto* pv = out->add_violations();
    pv->set_field(v.field);
    pv->set_description(v.description);
  }
  out->set_free_bytes(r.free_bytes);
  if (!r.valid()) return;
  if (!r.fits) {  // CreateCache would answer RESOURCE_EXHAUSTED: the dry run says why
    auto* pv = out->add_violations();
    pv->set_field(r.capacity_field);
    pv->set_description(std::string(ValidationStatus(r).message()));
  }
  ToProto(r.geometry, out->mutable_resolved_config());
  out->set_num_pages(r.geometry.num_pages);
  out->set_capacity_tokens(r.geometry.num_pages * r.geometry.page_size);
  out->set_bytes(r.bytes);
  out->set_fits(r.fits);
}

}  // namespace pagedattn
