// common/wire against protobuf's own encoder and parser: random Forward messages round-trip
// both ways whatever chunks they arrive in; truncated bytes fail both; garbage never crashes.
#include "common/wire.h"

#include <gtest/gtest.h>

#include <random>

#include "pagedattn/v1/attention.pb.h"

namespace pagedattn {
namespace {

std::vector<wire::Piece> Chunks(const std::string& bytes, std::mt19937& rng, int max_chunks) {
  std::vector<size_t> cuts = {0, bytes.size()};
  std::uniform_int_distribution<size_t> at(0, bytes.size());
  const int n = std::uniform_int_distribution<int>(0, max_chunks)(rng);
  for (int i = 0; i < n; ++i) cuts.push_back(at(rng));
  std::sort(cuts.begin(), cuts.end());
  std::vector<wire::Piece> out;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    out.push_back({bytes.data() + cuts[i], cuts[i + 1] - cuts[i]});  // empty pieces too
  }
  return out;
}

std::string Joined(const wire::TensorRef& t) {
  std::string s(t.data_size, '\0');
  t.CopyTo(s.data());
  return s;
}

v1::Tensor RandomTensor(std::mt19937& rng) {
  v1::Tensor t;
  t.set_dtype(static_cast<v1::DType>(rng() % 4));
  const int rank = static_cast<int>(rng() % 4);
  for (int i = 0; i < rank; ++i) t.add_shape(static_cast<int64_t>(rng() % 300) - 5);
  std::string data(rng() % 3000, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  t.set_data(data);
  return t;
}

v1::ForwardRequest RandomRequest(std::mt19937& rng) {
  v1::ForwardRequest r;
  r.set_cache_id(std::string(rng() % 40, 'c'));
  r.set_layer(static_cast<int32_t>(rng() % 7) - 2);
  const int spans = static_cast<int>(rng() % 5);
  for (int i = 0; i < spans; ++i) {
    v1::Span* s = r.add_spans();
    s->set_seq_id(rng() * uint64_t{rng()});
    s->set_start(static_cast<int64_t>(rng() % 100000) - 3);
    s->set_num_new_tokens(static_cast<int32_t>(rng() % 100) - 3);
    s->set_num_queries(static_cast<int32_t>(rng() % 100));
  }
  if (rng() % 4) *r.mutable_q() = RandomTensor(rng);
  if (rng() % 3) *r.mutable_k() = RandomTensor(rng);
  if (rng() % 3) *r.mutable_v() = RandomTensor(rng);
  if (rng() % 2) r.mutable_options()->set_causal(rng() % 2 == 0);
  if (rng() % 2) r.mutable_options()->set_sm_scale(static_cast<float>(rng() % 1000) / 7.f);
  if (rng() % 2) r.mutable_options()->set_return_lse(true);
  return r;
}

void ExpectSameTensor(const v1::Tensor& want, bool want_present, const wire::TensorRef& got) {
  EXPECT_EQ(got.present, want_present);
  if (!want_present) return;
  EXPECT_EQ(got.dtype, want.dtype());
  EXPECT_EQ(got.shape, std::vector<int64_t>(want.shape().begin(), want.shape().end()));
  EXPECT_EQ(Joined(got), want.data());
}

TEST(WireTest, ParsesWhatProtobufWritesInAnyChunks) {
  std::mt19937 rng(1);
  for (int iter = 0; iter < 500; ++iter) {
    const v1::ForwardRequest r = RandomRequest(rng);
    const std::string bytes = r.SerializeAsString();
    wire::ForwardRequestRef got;
    std::string error;
    ASSERT_TRUE(wire::ParseForwardRequest(Chunks(bytes, rng, 12), &got, &error)) << error;
    EXPECT_EQ(got.cache_id, r.cache_id());
    EXPECT_EQ(got.layer, r.layer());
    ASSERT_EQ(got.spans.size(), static_cast<size_t>(r.spans_size()));
    for (int i = 0; i < r.spans_size(); ++i) {
      EXPECT_EQ(got.spans[i].seq_id, r.spans(i).seq_id());
      EXPECT_EQ(got.spans[i].start, r.spans(i).start());
      EXPECT_EQ(got.spans[i].num_new_tokens, r.spans(i).num_new_tokens());
      EXPECT_EQ(got.spans[i].num_queries, r.spans(i).num_queries());
    }
    ExpectSameTensor(r.q(), r.has_q(), got.q);
    ExpectSameTensor(r.k(), r.has_k(), got.k);
    ExpectSameTensor(r.v(), r.has_v(), got.v);
    EXPECT_EQ(got.options.causal.has_value(), r.options().has_causal());
    if (r.options().has_causal()) {
      EXPECT_EQ(*got.options.causal, r.options().causal());
    }
    EXPECT_EQ(got.options.sm_scale.has_value(), r.options().has_sm_scale());
    if (r.options().has_sm_scale()) {
      EXPECT_EQ(*got.options.sm_scale, r.options().sm_scale());
    }
    EXPECT_EQ(got.options.return_lse, r.options().return_lse());
  }
}

// Unknown fields are skipped, a repeated singular field's last value wins, shapes may arrive
// unpacked, and a tensor field seen twice is merged (shape appended, data replaced).
TEST(WireTest, FollowsProtobufRulesForOddButValidMessages) {
  std::mt19937 rng(2);
  for (int iter = 0; iter < 200; ++iter) {
    v1::ForwardRequest a = RandomRequest(rng), b = RandomRequest(rng);
    std::string bytes = a.SerializeAsString();
    // An unknown field of every wire type, then b: a message concatenated is a merge.
    bytes += std::string("\xf8\x07\x05", 3) + std::string("\xf9\x07", 2) + std::string(8, 'x') +
             std::string("\xfa\x07\x03yyy", 6) + std::string("\xfd\x07", 2) + std::string(4, 'z');
    bytes += b.SerializeAsString();
    v1::ForwardRequest want;
    ASSERT_TRUE(want.ParseFromString(bytes));
    wire::ForwardRequestRef got;
    std::string error;
    ASSERT_TRUE(wire::ParseForwardRequest(Chunks(bytes, rng, 8), &got, &error)) << error;
    EXPECT_EQ(got.cache_id, want.cache_id());
    EXPECT_EQ(got.layer, want.layer());
    EXPECT_EQ(got.spans.size(), static_cast<size_t>(want.spans_size()));
    ExpectSameTensor(want.q(), want.has_q(), got.q);
    ExpectSameTensor(want.k(), want.has_k(), got.k);
    EXPECT_EQ(got.options.return_lse, want.options().return_lse());
  }
  // Unpacked shape entries (each its own varint field).
  // q: shape 3, shape 5 unpacked; data empty; a dtype sent with the wrong wire type (skipped
  // as protobuf skips it).
  const std::string unpacked("\x22\x09\x10\x03\x10\x05\x1a\x00\x0a\x01\x07", 11);
  wire::ForwardRequestRef got;
  std::string error;
  ASSERT_TRUE(wire::ParseForwardRequest({{unpacked.data(), unpacked.size()}}, &got, &error))
      << error;
  EXPECT_EQ(got.q.shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(got.q.dtype, 0);
  v1::ForwardRequest pb;
  ASSERT_TRUE(pb.ParseFromString(unpacked));
  EXPECT_EQ(pb.q().shape_size(), 2);
  EXPECT_EQ(pb.q().dtype(), 0);
}

TEST(WireTest, ProtobufParsesWhatWeWrite) {
  std::mt19937 rng(3);
  for (int iter = 0; iter < 300; ++iter) {
    const v1::ForwardRequest r = RandomRequest(rng);
    std::vector<wire::SpanRef> spans;
    for (const v1::Span& s : r.spans()) {
      spans.push_back({s.seq_id(), s.start(), s.num_new_tokens(), s.num_queries()});
    }
    wire::ForwardOptionsRef opts;
    if (r.options().has_causal()) opts.causal = r.options().causal();
    if (r.options().has_sm_scale()) opts.sm_scale = r.options().sm_scale();
    opts.return_lse = r.options().return_lse();
    std::string bytes = wire::ForwardRequestHead(r.cache_id(), r.layer(), spans, opts);
    auto add = [&](int field, bool has, const v1::Tensor& t) {
      if (!has) return;
      bytes += wire::TensorFieldPrefix(field, t.dtype(),
                                       std::vector<int64_t>(t.shape().begin(), t.shape().end()),
                                       t.data().size());
      bytes += t.data();
    };
    add(wire::kRequestQ, r.has_q(), r.q());
    add(wire::kRequestK, r.has_k(), r.k());
    add(wire::kRequestV, r.has_v(), r.v());
    v1::ForwardRequest back;
    ASSERT_TRUE(back.ParseFromString(bytes));
    EXPECT_EQ(back.SerializeAsString(), r.SerializeAsString());
  }
  v1::ForwardResponse resp;
  resp.mutable_out()->set_dtype(v1::BFLOAT16);
  resp.mutable_out()->add_shape(2);
  resp.mutable_out()->set_data("abcd");
  const std::string bytes =
      wire::TensorFieldPrefix(wire::kResponseOut, v1::BFLOAT16, {2}, 4) + "abcd";
  EXPECT_EQ(bytes, resp.SerializeAsString());
  wire::ForwardResponseRef got;
  std::string error;
  ASSERT_TRUE(wire::ParseForwardResponse({{bytes.data(), bytes.size()}}, &got, &error)) << error;
  EXPECT_EQ(Joined(got.out), "abcd");
  EXPECT_FALSE(got.lse.present);
}

TEST(WireTest, TruncatedMessagesFailAndGarbageNeverCrashes) {
  std::mt19937 rng(4);
  for (int iter = 0; iter < 200; ++iter) {
    const std::string bytes = RandomRequest(rng).SerializeAsString();
    if (bytes.empty()) continue;
    const size_t cut = rng() % bytes.size();
    const std::string head = bytes.substr(0, cut);
    v1::ForwardRequest pb;
    const bool pb_ok = pb.ParseFromString(head);
    wire::ForwardRequestRef got;
    std::string error;
    EXPECT_EQ(wire::ParseForwardRequest(Chunks(head, rng, 4), &got, &error), pb_ok)
        << "cut at " << cut << ": " << error;
    if (!pb_ok) {
      EXPECT_FALSE(error.empty());
    }
  }
  for (int iter = 0; iter < 2000; ++iter) {
    std::string junk(rng() % 200, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    wire::ForwardRequestRef got;
    std::string error;
    (void)wire::ParseForwardRequest(Chunks(junk, rng, 5), &got, &error);
  }
}

// Bytes protobuf refuses are refused here too (a wider key or length read as a smaller one, a
// field number past 2^29 - 1, a string that is not UTF-8), each saying why.
TEST(WireTest, RefusesWhatProtobufRefuses) {
  const std::string id(32, 'c');
  struct Case {
    std::string bytes;
    const char* why;
  };
  const std::vector<Case> cases = {
      {std::string("\x8a\x80\x80\x80\x80\x01\x20", 7) + id, "overlong field key"},  // 6 bytes
      {std::string("\x8a\x80\x80\x80\x80\x00\x20", 7) + id, "overlong field key"},
      {std::string("\x80\x80\x80\x80\x10\x01", 6), "field number past"},  // field 2^29
      {std::string("\x0a\xa0\x80\x80\x80\x80\x00", 7) + id, "overlong length"},
      {std::string("\x0a\x02\xff\xfe", 4), "cache_id is not UTF-8"},
      {std::string("\x0a\x02\xc0\x80", 4), "cache_id is not UTF-8"},        // overlong NUL
      {std::string("\x0a\x03\xed\xa0\x80", 5), "cache_id is not UTF-8"},    // a surrogate
  };
  for (const Case& c : cases) {
    v1::ForwardRequest pb;
    EXPECT_FALSE(pb.ParseFromString(c.bytes)) << c.why;
    wire::ForwardRequestRef got;
    std::string error;
    EXPECT_FALSE(wire::ParseForwardRequest({{c.bytes.data(), c.bytes.size()}}, &got, &error))
        << c.why;
    EXPECT_NE(error.find(c.why), std::string::npos) << error;
  }
  // UTF-8 of every length passes, as a 5-byte key does.
  v1::ForwardRequest pb;
  pb.set_cache_id("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  std::string bytes = pb.SerializeAsString();
  wire::ForwardRequestRef got;
  std::string error;
  ASSERT_TRUE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error)) << error;
  EXPECT_EQ(got.cache_id, pb.cache_id());
  bytes = std::string("\x90\x80\x80\x80\x00\x05", 6);  // layer = 5, its key in 5 bytes
  ASSERT_TRUE(pb.ParseFromString(bytes));
  ASSERT_TRUE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error)) << error;
  EXPECT_EQ(got.layer, 5);
  // A 10-byte varint's bits past 64 are dropped, as protobuf drops them: layer = 5 and a seq_id
  // of 2^63 + 3 (an 11th byte is refused by both).
  for (const char last : {'\x02', '\x7e', '\x7f'}) {
    bytes = std::string("\x10\x85\x80\x80\x80\x80\x80\x80\x80\x80", 10) + last +
            std::string("\x1a\x0b\x08\x83\x80\x80\x80\x80\x80\x80\x80\x80", 12) + '\x7f';
    ASSERT_TRUE(pb.ParseFromString(bytes)) << int{last};
    ASSERT_TRUE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error)) << error;
    EXPECT_EQ(got.layer, pb.layer());
    EXPECT_EQ(got.layer, 5);
    ASSERT_EQ(got.spans.size(), 1u);
    EXPECT_EQ(got.spans[0].seq_id, pb.spans(0).seq_id());
    EXPECT_EQ(got.spans[0].seq_id, (uint64_t{1} << 63) + 3);
  }
  bytes = std::string("\x10\x85\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 12);
  EXPECT_FALSE(pb.ParseFromString(bytes));
  EXPECT_FALSE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error));
  EXPECT_NE(error.find("overlong varint"), std::string::npos) << error;
}

// Repeated fields are bounded as they are read: a request of many empty spans (2 bytes each) or
// shape entries (1 byte each) is refused before it grows the parse 10-25 times its size.
TEST(WireTest, RepeatedFieldsAreBoundedAsTheyAreRead) {
  v1::ForwardRequest pb;
  for (int i = 0; i < 5; ++i) pb.add_spans()->set_seq_id(i);
  for (int i = 0; i < 9; ++i) pb.mutable_q()->add_shape(1);
  const std::string bytes = pb.SerializeAsString();
  wire::ForwardRequestRef got;
  std::string error;
  wire::ParseLimits limits;
  limits.max_spans = 4;
  limits.max_shape_dims = 9;
  EXPECT_FALSE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error, limits));
  EXPECT_NE(error.find("at most 4 spans per Forward"), std::string::npos) << error;
  limits.max_spans = 5;
  EXPECT_TRUE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error, limits))
      << error;
  EXPECT_EQ(got.spans.size(), 5u);
  // The default: 8 dims, whether packed or one entry at a time.
  EXPECT_FALSE(wire::ParseForwardRequest({{bytes.data(), bytes.size()}}, &got, &error));
  EXPECT_NE(error.find("at most 8 dims in q.shape (got more)"), std::string::npos) << error;
  std::string unpacked = std::string("\x22\x12", 2);  // q: 9 unpacked shape entries
  for (int i = 0; i < 9; ++i) unpacked += std::string("\x10\x01", 2);
  EXPECT_FALSE(wire::ParseForwardRequest({{unpacked.data(), unpacked.size()}}, &got, &error));
  EXPECT_NE(error.find("at most 8 dims in q.shape"), std::string::npos) << error;
}

}  // namespace
}  // namespace pagedattn
