// ParseForward + ToForwardArgs: the request's tensors land byte-exact in the backend's buffers,
// whether the handler copies them alone or a copy pool does, and whatever the chunking.
#include "server/service/forward_wire.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "pagedattn/v1/attention.pb.h"
#include "server/core/backend.h"
#include "server/core/thread_pool.h"

namespace pagedattn {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// A ForwardRequest of `tokens` tokens (32 q heads, 8 kv heads, head dim 128, bf16) as a byte
// buffer of slices of `chunk` bytes.
grpc::ByteBuffer Request(int tokens, size_t chunk, v1::ForwardRequest* proto) {
  proto->set_cache_id("c");
  auto* span = proto->add_spans();
  span->set_seq_id(1);
  span->set_num_new_tokens(tokens);
  span->set_num_queries(tokens);
  uint32_t seed = 1;
  for (auto [t, heads] :
       {std::pair{proto->mutable_q(), 32}, {proto->mutable_k(), 8}, {proto->mutable_v(), 8}}) {
    t->set_dtype(v1::BFLOAT16);
    t->add_shape(tokens);
    t->add_shape(heads);
    t->add_shape(128);
    t->set_data(RandomBytes(static_cast<size_t>(tokens) * heads * 128 * 2, seed++));
  }
  const std::string wire = proto->SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t off = 0; off < wire.size(); off += chunk) {
    slices.emplace_back(wire.data() + off, std::min(chunk, wire.size() - off));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void ExpectPlaced(int tokens, size_t chunk, ThreadPool* pool) {
  v1::ForwardRequest proto;
  const grpc::ByteBuffer buffer = Request(tokens, chunk, &proto);
  ReceivedForward received;
  ASSERT_TRUE(ParseForward(buffer, &received).ok());
  HeapForwardBuffers buffers(QBytes(received.request), KvBytes(received.request), 0, 0);
  const ForwardArgs args = ToForwardArgs(received.request, &buffers, pool);
  ASSERT_EQ(args.q.size_bytes, proto.q().data().size());
  EXPECT_EQ(std::string(static_cast<const char*>(args.q.data), args.q.size_bytes),
            proto.q().data());
  EXPECT_EQ(std::string(static_cast<const char*>(args.k.data), args.k.size_bytes),
            proto.k().data());
  EXPECT_EQ(std::string(static_cast<const char*>(args.v.data), args.v.size_bytes),
            proto.v().data());
  EXPECT_EQ(args.q.data, buffers.q());
  EXPECT_EQ(args.k.data, buffers.k());
  EXPECT_EQ(args.v.data, buffers.v());
}

TEST(ForwardWireTest, SmallRequestIsCopiedByTheHandler) {
  ThreadPool pool(4);
  ExpectPlaced(2, 1000, &pool);  // below kParallelCopyBytes
  ExpectPlaced(2, 1000, nullptr);
}

TEST(ForwardWireTest, LargeRequestIsCopiedByThePoolWhateverTheChunks) {
  ThreadPool pool(4);
  // 64 decode tokens: 786 KiB of q/k/v, above kParallelCopyBytes.
  for (size_t chunk : {size_t{7} << 10, size_t{4096} + 13, size_t{1} << 20, size_t{64} << 20}) {
    SCOPED_TRACE(chunk);
    ExpectPlaced(64, chunk, &pool);
  }
  ThreadPool three(3);  // shares that do not divide the sizes
  ExpectPlaced(61, 5000, &three);
}

}  // namespace
}  // namespace pagedattn
