// The same mixed prefill + chunked prefill + decode Forwards over gRPC on a CUDA server and a
// CPU server: the answers must agree within bf16 tolerance. Skips without a GPU.
#include <gtest/gtest.h>

#include <random>

#include "client/client.h"
#include "common/reference.h"
#include "server/core/backend_factory.h"
#include "server/service/server.h"

namespace pagedattn {
namespace {

struct Step {
  int layer;
  std::vector<std::array<int64_t, 4>> spans;  // seq, start, new, queries
};

TEST(BackendParityTest, CudaMatchesCpuOverGrpc) {
  if (!BuiltWithCuda()) GTEST_SKIP() << "built without CUDA (no nvcc at build time)";
  if (absl::StatusOr<CreatedBackend> cuda = CreateBackend({.backend = BackendChoice::kCuda});
      !cuda.ok()) {
    GTEST_SKIP() << "no CUDA GPU visible: " << cuda.status();
  }
  std::unique_ptr<PagedAttnServer> servers[2];
  std::unique_ptr<Client> clients[2];
  std::string caches[2];
  const char* backends[2] = {"cpu", "cuda"};
  for (int i = 0; i < 2; ++i) {
    ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.backend.backend = i == 0 ? BackendChoice::kCpu : BackendChoice::kCuda;
    servers[i] = *PagedAttnServer::Start(o);
    ClientOptions c;
    c.target = absl::StrCat("127.0.0.1:", servers[i]->port());
    clients[i] = *Client::Connect(c);
    EXPECT_EQ(clients[i]->GetServerInfo()->backend(), backends[i]);
    v1::CacheConfig cfg;
    cfg.set_num_layers(2);
    cfg.set_num_q_heads(32);
    cfg.set_num_kv_heads(8);
    cfg.set_head_dim(128);
    cfg.set_page_size(16);
    cfg.set_kv_dtype(v1::BFLOAT16);
    cfg.set_num_pages(512);
    absl::StatusOr<v1::CacheInfo> info = clients[i]->CreateCache(cfg);
    ASSERT_TRUE(info.ok()) << info.status();
    caches[i] = info->cache_id();
  }
  const std::vector<Step> steps = {
      {0,
       {{1, 0, 300, 300},
        {2, 0, 17, 17},
        {3, 0, 1000, 1}}},  // prefills, one of them append-only-ish
      {0, {{1, 300, 1, 1}, {2, 17, 64, 64}, {3, 1000, 1, 1}}},  // decode, chunked prefill, decode
      {1, {{1, 0, 301, 5}, {4, 0, 33, 33}}},                    // the other layer
      {0, {{1, 290, 2, 2}, {2, 81, 0, 3}, {3, 1001, 4, 4}}},    // rewind, attend-only, speculative
  };
  std::mt19937 rng(42);
  std::normal_distribution<float> dist;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& st = steps[si];
    v1::ForwardRequest req;
    req.set_layer(st.layer);
    req.mutable_options()->set_return_lse(true);
    int64_t tq = 0, tn = 0;
    for (const auto& s : st.spans) {
      v1::Span* sp = req.add_spans();
      sp->set_seq_id(s[0]);
      sp->set_start(s[1]);
      sp->set_num_new_tokens(static_cast<int32_t>(s[2]));
      sp->set_num_queries(static_cast<int32_t>(s[3]));
      tn += s[2];
      tq += s[3];
    }
    auto values = [&](int64_t n) {
      std::vector<float> v(static_cast<size_t>(n));
      for (float& x : v) x = dist(rng);
      return v;
    };
    *req.mutable_q() = MakeTensor(v1::BFLOAT16, {tq, 32, 128}, values(tq * 32 * 128));
    if (tn > 0) {
      *req.mutable_k() = MakeTensor(v1::BFLOAT16, {tn, 8, 128}, values(tn * 8 * 128));
      *req.mutable_v() = MakeTensor(v1::BFLOAT16, {tn, 8, 128}, values(tn * 8 * 128));
    }
    std::vector<float> out[2], lse[2];
    for (int i = 0; i < 2; ++i) {
      req.set_cache_id(caches[i]);
      absl::StatusOr<v1::ForwardResponse> r = clients[i]->Forward(req);
      ASSERT_TRUE(r.ok()) << backends[i] << " step " << si << ": " << r.status();
      out[i] = *TensorToFloats(r->out());
      lse[i] = *TensorToFloats(r->lse());
    }
    ASSERT_EQ(out[0].size(), static_cast<size_t>(tq * 32 * 128));
    ASSERT_EQ(out[1].size(), out[0].size());
    std::vector<double> cpu(out[0].begin(), out[0].end()), gpu(out[1].begin(), out[1].end());
    for (double x : gpu) ASSERT_FALSE(std::isnan(x)) << "step " << si;
    const double err =
        testing::RelativeError(gpu.data(), cpu.data(), static_cast<int64_t>(cpu.size()));
    EXPECT_LE(err, 1e-2) << "step " << si;
    double lse_err = 0;
    for (size_t j = 0; j < lse[0].size(); ++j)
      lse_err = std::max(lse_err, double(std::abs(lse[0][j] - lse[1][j])));
    EXPECT_LE(lse_err, 1e-2) << "step " << si;
    std::printf("step %zu: cuda vs cpu rel err %.3g, max lse diff %.3g\n", si, err, lse_err);
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(clients[i]->GetCache(caches[i])->stats().used_pages(),
              clients[0]->GetCache(caches[0])->stats().used_pages());
  }
}

}  // namespace
}  // namespace pagedattn
