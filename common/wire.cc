// The protobuf wire format of the Forward messages by hand: a reader over a message's chunks
// that hands out tensor data as pieces of those chunks, and the encoders of the few headers.
#include "common/wire.h"

#include <cstring>

namespace pagedattn::wire {
namespace {

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLength = 2, kFixed32 = 5 };

// Reads a message spread over chunks, keeping an absolute position.
class Reader {
 public:
  explicit Reader(const std::vector<Piece>& chunks) : chunks_(chunks) {
    for (const Piece& c : chunks) total_ += c.size;
    SkipEmpty();
  }

  size_t pos() const { return pos_; }
  size_t total() const { return total_; }

  bool ReadByte(uint8_t* b) {
    if (pos_ >= total_) return false;
    *b = static_cast<uint8_t>(chunks_[chunk_].data[offset_]);
    Advance(1);
    return true;
  }

  // A varint of at most max_bytes bytes (protobuf's: 5 for a key or a length, 10 otherwise).
  // The bits of a tenth byte past the 64th are dropped, as protobuf drops them.
  bool ReadVarint(uint64_t* v, int max_bytes = 10) {
    *v = 0;
    for (int shift = 0; shift < 7 * max_bytes; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  bool ReadFixed32(uint32_t* v) {
    uint8_t bytes[4];
    for (uint8_t& b : bytes) {
      if (!ReadByte(&b)) return false;
    }
    *v = uint32_t{bytes[0]} | uint32_t{bytes[1]} << 8 | uint32_t{bytes[2]} << 16 |
         uint32_t{bytes[3]} << 24;
    return true;
  }

  // The next n bytes as pieces of the chunks (appended to out).
  bool ReadPieces(size_t n, std::vector<Piece>* out) {
    if (n > total_ - pos_) return false;
    while (n > 0) {
      const Piece& c = chunks_[chunk_];
      const size_t take = std::min(n, c.size - offset_);
      out->push_back({c.data + offset_, take});
      Advance(take);
      n -= take;
    }
    return true;
  }

  bool ReadString(size_t n, std::string* out) {
    std::vector<Piece> pieces;
    if (!ReadPieces(n, &pieces)) return false;
    out->clear();
    out->reserve(n);
    for (const Piece& p : pieces) out->append(p.data, p.size);
    return true;
  }

  bool Skip(size_t n) {
    if (n > total_ - pos_) return false;
    while (n > 0) {
      const size_t take = std::min(n, chunks_[chunk_].size - offset_);
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    pos_ += n;
    SkipEmpty();
  }
  void SkipEmpty() {
    while (chunk_ < chunks_.size() && offset_ >= chunks_[chunk_].size) {
      ++chunk_;
      offset_ = 0;
    }
  }

  const std::vector<Piece>& chunks_;
  size_t chunk_ = 0, offset_ = 0, pos_ = 0, total_ = 0;
};

// protobuf's bounds on a key's field number and on a length-delimited field's length.
constexpr uint64_t kMaxFieldNumber = (uint64_t{1} << 29) - 1;
constexpr uint64_t kMaxLength = (uint64_t{1} << 31) - 1;

// Whether bytes are UTF-8 (what a proto3 string must be): no overlong forms, no surrogates,
// nothing past U+10FFFF.
bool IsUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80           ? 1
                  : (c >> 5) == 0x6  ? 2
                  : (c >> 4) == 0xe  ? 3
                  : (c >> 3) == 0x1e ? 4
                                     : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t code = n == 1 ? c : c & (0xff >> (n + 1));
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      code = code << 6 | (b & 0x3f);
    }
    const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < least[n] || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return false;
    i += n;
  }
  return true;
}

// One message's fields, between the reader's position and `end`: each field's number and wire
// type goes to on_field, which reads the value (or returns false to have it skipped).
class Parser {
 public:
  Parser(Reader& r, std::string* error, const ParseLimits& limits)
      : r_(r), error_(error), limits_(limits) {}

  bool Fail(const std::string& why) {
    if (error_->empty()) *error_ = why + " at byte " + std::to_string(r_.pos());
    return false;
  }

  // Reads fields until `end`; on_field(number, wire_type) returns 1 (read), 0 (skip it), or
  // -1 (malformed).
  template <typename OnField>
  bool Fields(size_t end, OnField&& on_field) {
    while (r_.pos() < end) {
      uint64_t key;
      if (!r_.ReadVarint(&key, 5)) return Fail("truncated or overlong field key");
      if ((key >> 3) > kMaxFieldNumber) return Fail("field number past 2^29 - 1");
      const uint32_t number = static_cast<uint32_t>(key >> 3);
      const uint32_t type = static_cast<uint32_t>(key & 7);
      if (number == 0) return Fail("field number 0");
      // A known field with another wire type is an unknown field to protobuf: skipped.
      const int handled = on_field(number, type);
      if (handled < 0) return false;
      if (handled == 0 && !SkipValue(type)) return false;
      if (r_.pos() > end) return Fail("a field runs past the end of its message");
    }
    return true;
  }

  bool SkipValue(uint32_t type) {
    uint64_t v = 0;
    switch (type) {
      case kVarint:
        return r_.ReadVarint(&v) || Fail("truncated or overlong varint");
      case kFixed64:
        return r_.Skip(8) || Fail("truncated fixed64");
      case kLength:
        return (r_.ReadVarint(&v, 5) && v <= kMaxLength && r_.Skip(v)) ||
               Fail("truncated or overlong length-delimited field");
      case kFixed32:
        return r_.Skip(4) || Fail("truncated fixed32");
      default:  // groups (3, 4), which proto3 never sends, and 6, 7
        return Fail("unsupported wire type " + std::to_string(type));
    }
  }

  bool Varint(uint64_t* v) { return r_.ReadVarint(v) || Fail("truncated or overlong varint"); }

  // A length-delimited field's end position.
  bool LengthEnd(size_t* end) {
    uint64_t len;
    if (!r_.ReadVarint(&len, 5) || len > kMaxLength) return Fail("truncated or overlong length");
    if (len > r_.total() - r_.pos()) return Fail("a length runs past the end of the message");
    *end = r_.pos() + static_cast<size_t>(len);
    return true;
  }

  // A string field (length-delimited; the caller checked the wire type) into *out.
  bool String(const char* name, std::string* out) {
    size_t end = 0;
    if (!LengthEnd(&end)) return false;
    if (!r_.ReadString(end - r_.pos(), out)) return Fail(std::string("truncated ") + name);
    return IsUtf8(*out) || Fail(std::string(name) + " is not UTF-8");
  }

  // One more entry of a repeated field that has `size` already: false past `limit`, with an
  // error that starts "at most" (a limit, not malformed bytes: ParseForwardRequest).
  // "at most <limit> <what><name><after>", the error's words built only when it fails.
  bool Room(size_t size, size_t limit, const char* what, const char* name = "",
            const char* after = "") {
    if (size < limit) return true;
    if (error_->empty()) {
      *error_ = "at most " + std::to_string(limit) + " " + what + name + after;
    }
    return false;
  }

  // A Tensor field (length-delimited; the caller checked the wire type), merged into *t; name:
  // the field's, for errors ("q").
  bool Tensor(TensorRef* t, const char* name) {
    size_t end = 0;
    if (!LengthEnd(&end)) return false;
    t->present = true;
    return Fields(end, [&](uint32_t number, uint32_t wt) -> int {
      uint64_t v = 0;
      if (number == 1 && wt == kVarint) {
        if (!Varint(&v)) return -1;
        t->dtype = static_cast<int32_t>(v);
        return 1;
      }
      if (number == 2 && wt == kVarint) {  // one unpacked entry
        if (!Varint(&v)) return -1;
        if (!Room(t->shape.size(), limits_.max_shape_dims, "dims in ", name, ".shape (got more)"))
          return -1;
        t->shape.push_back(static_cast<int64_t>(v));
        return 1;
      }
      if (number == 2 && wt == kLength) {  // packed entries
        size_t packed_end = 0;
        if (!LengthEnd(&packed_end)) return -1;
        while (r_.pos() < packed_end) {
          if (!r_.ReadVarint(&v)) return Fail("truncated packed shape"), -1;
          if (!Room(t->shape.size(), limits_.max_shape_dims, "dims in ", name,
                    ".shape (got more)")) {
            return -1;
          }
          t->shape.push_back(static_cast<int64_t>(v));
        }
        return r_.pos() == packed_end ? 1 : (Fail("packed shape overruns"), -1);
      }
      if (number == 3 && wt == kLength) {
        size_t data_end = 0;
        if (!LengthEnd(&data_end)) return -1;
        t->data.clear();
        t->data_size = data_end - r_.pos();
        return r_.ReadPieces(t->data_size, &t->data) ? 1 : -1;
      }
      if (number == 4 && wt == kLength) {  // DeviceBuffer
        size_t buffer_end = 0;
        if (!LengthEnd(&buffer_end)) return -1;
        t->on_device = true;
        return Fields(buffer_end,
                      [&](uint32_t n, uint32_t bt) -> int {
                        if (n == 1 && bt == kLength) {
                          return String("region_id", &t->region_id) ? 1 : -1;
                        }
                        if (n == 2 && bt == kVarint) {
                          if (!Varint(&v)) return -1;
                          t->offset = static_cast<int64_t>(v);
                          return 1;
                        }
                        return 0;
                      })
                   ? 1
                   : -1;
      }
      return 0;
    });
  }

  Reader& reader() { return r_; }
  const ParseLimits& limits() const { return limits_; }

 private:
  Reader& r_;
  std::string* error_;
  const ParseLimits& limits_;
};

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void PutTag(std::string* out, int number, WireType type) {
  PutVarint(out, (static_cast<uint64_t>(number) << 3) | type);
}

void PutLengthField(std::string* out, int number, const std::string& bytes) {
  PutTag(out, number, kLength);
  PutVarint(out, bytes.size());
  out->append(bytes);
}

// int32/int64 fields: negative values as their 64-bit two's complement (10 bytes).
uint64_t AsVarint(int64_t v) { return static_cast<uint64_t>(v); }

// A Tensor's dtype and shape fields.
std::string TensorHead(int32_t dtype, const std::vector<int64_t>& shape) {
  std::string head;
  if (dtype != 0) {
    PutTag(&head, 1, kVarint);
    PutVarint(&head, AsVarint(dtype));
  }
  if (!shape.empty()) {
    std::string packed;
    for (int64_t d : shape) PutVarint(&packed, AsVarint(d));
    PutLengthField(&head, 2, packed);
  }
  return head;
}

}  // namespace

void TensorRef::CopyTo(char* dst) const {
  for (const Piece& p : data) {
    std::memcpy(dst, p.data, p.size);
    dst += p.size;
  }
}

bool ParseForwardRequest(const std::vector<Piece>& chunks, ForwardRequestRef* out,
                         std::string* error, const ParseLimits& limits) {
  error->clear();
  *out = ForwardRequestRef();
  Reader r(chunks);
  Parser p(r, error, limits);
  // Each handler reads its field when the wire type is the field's, and returns 0 (skip it as
  // an unknown field, as protobuf does) otherwise.
  return p.Fields(r.total(), [&](uint32_t number, uint32_t type) -> int {
    uint64_t v = 0;
    size_t end = 0;
    if (number == 1 && type == kLength) return p.String("cache_id", &out->cache_id) ? 1 : -1;
    if (number == 2 && type == kVarint) {
      if (!p.Varint(&v)) return -1;
      out->layer = static_cast<int32_t>(v);
      return 1;
    }
    if (number == 3 && type == kLength) {
      if (!p.Room(out->spans.size(), limits.max_spans,
                  "spans per Forward (the server's --max_forward_spans)")) {
        return -1;
      }
      if (!p.LengthEnd(&end)) return -1;
      SpanRef s;
      const bool ok = p.Fields(end, [&](uint32_t n, uint32_t t) -> int {
        if (n < 1 || n > 4 || t != kVarint) return 0;
        if (!p.Varint(&v)) return -1;
        if (n == 1) s.seq_id = v;
        if (n == 2) s.start = static_cast<int64_t>(v);
        if (n == 3) s.num_new_tokens = static_cast<int32_t>(v);
        if (n == 4) s.num_queries = static_cast<int32_t>(v);
        return 1;
      });
      out->spans.push_back(s);
      return ok ? 1 : -1;
    }
    if (number == kRequestQ && type == kLength) return p.Tensor(&out->q, "q") ? 1 : -1;
    if (number == kRequestK && type == kLength) return p.Tensor(&out->k, "k") ? 1 : -1;
    if (number == kRequestV && type == kLength) return p.Tensor(&out->v, "v") ? 1 : -1;
    if (number == kRequestOut && type == kLength) return p.Tensor(&out->out, "out") ? 1 : -1;
    if (number == kRequestLse && type == kLength) return p.Tensor(&out->lse, "lse") ? 1 : -1;
    if (number == kRequestSync && type == kLength) {
      if (!p.LengthEnd(&end)) return -1;
      out->sync.present = true;
      return p.Fields(end,
                      [&](uint32_t n, uint32_t t) -> int {
                        if (n == 1 && t == kLength) {
                          return p.String("sync.region_id", &out->sync.region_id) ? 1 : -1;
                        }
                        if ((n == 2 || n == 3) && t == kVarint) {
                          if (!p.Varint(&v)) return -1;
                          (n == 2 ? out->sync.wait_event : out->sync.done_event) =
                              static_cast<int32_t>(v);
                          return 1;
                        }
                        return 0;
                      })
                 ? 1
                 : -1;
    }
    if (number == 7 && type == kLength) {
      if (!p.LengthEnd(&end)) return -1;
      const bool ok = p.Fields(end, [&](uint32_t n, uint32_t t) -> int {
        if ((n == 1 || n == 3) && t == kVarint) {
          if (!p.Varint(&v)) return -1;
          if (n == 1) out->options.causal = v != 0;
          if (n == 3) out->options.return_lse = v != 0;
          return 1;
        }
        if (n == 2 && t == kFixed32) {
          uint32_t bits;
          if (!r.ReadFixed32(&bits)) return p.Fail("truncated sm_scale"), -1;
          float f;
          std::memcpy(&f, &bits, 4);
          out->options.sm_scale = f;
          return 1;
        }
        return 0;
      });
      return ok ? 1 : -1;
    }
    return 0;
  });
}

bool ParseForwardResponse(const std::vector<Piece>& chunks, ForwardResponseRef* out,
                          std::string* error, const ParseLimits& limits) {
  error->clear();
  *out = ForwardResponseRef();
  Reader r(chunks);
  Parser p(r, error, limits);
  return p.Fields(r.total(), [&](uint32_t number, uint32_t type) -> int {
    uint64_t v = 0;
    size_t end = 0;
    if (number == kResponseOut && type == kLength) return p.Tensor(&out->out, "out") ? 1 : -1;
    if (number == kResponseLse && type == kLength) return p.Tensor(&out->lse, "lse") ? 1 : -1;
    if (number == 3 && type == kVarint) {
      if (!p.Varint(&v)) return -1;
      out->layer = static_cast<int32_t>(v);
      return 1;
    }
    if (number == 4 && type == kLength) {
      if (!p.LengthEnd(&end)) return -1;
      return r.ReadString(end - r.pos(), &out->error_status) ? 1 : -1;
    }
    if (number == 5 && type == kLength) {
      if (!p.LengthEnd(&end)) return -1;
      const bool ok = p.Fields(end, [&](uint32_t n, uint32_t t) -> int {
        if ((n != 1 && n != 2) || t != kVarint) return 0;
        if (!p.Varint(&v)) return -1;
        (n == 1 ? out->server_micros : out->kernel_micros) = static_cast<int64_t>(v);
        return 1;
      });
      return ok ? 1 : -1;
    }
    return 0;
  });
}

std::string TensorFieldPrefix(int field_number, int32_t dtype, const std::vector<int64_t>& shape,
                              size_t data_size) {
  std::string inner = TensorHead(dtype, shape);
  PutTag(&inner, 3, kLength);
  PutVarint(&inner, data_size);
  std::string prefix;
  PutTag(&prefix, field_number, kLength);
  PutVarint(&prefix, inner.size() + data_size);
  prefix += inner;
  return prefix;
}

std::string DeviceTensorField(int field_number, int32_t dtype, const std::vector<int64_t>& shape,
                              const std::string& region_id, int64_t offset) {
  std::string inner = TensorHead(dtype, shape);
  std::string buffer;
  if (!region_id.empty()) PutLengthField(&buffer, 1, region_id);
  if (offset != 0) {
    PutTag(&buffer, 2, kVarint);
    PutVarint(&buffer, AsVarint(offset));
  }
  PutLengthField(&inner, 4, buffer);
  std::string field;
  PutLengthField(&field, field_number, inner);
  return field;
}

std::string DeviceSyncField(const DeviceSyncRef& sync) {
  std::string inner;
  if (!sync.region_id.empty()) PutLengthField(&inner, 1, sync.region_id);
  for (const auto& [number, value] : {std::pair{2, sync.wait_event}, {3, sync.done_event}}) {
    if (value == 0) continue;
    PutTag(&inner, number, kVarint);
    PutVarint(&inner, AsVarint(value));
  }
  std::string field;
  PutLengthField(&field, kRequestSync, inner);
  return field;
}

std::string StepResponseFields(int32_t layer, const std::string& error_status,
                               int64_t server_micros, int64_t kernel_micros) {
  std::string out;
  if (layer != 0) {
    PutTag(&out, 3, kVarint);
    PutVarint(&out, AsVarint(layer));
  }
  if (!error_status.empty()) PutLengthField(&out, 4, error_status);
  std::string timing;
  if (server_micros != 0) {
    PutTag(&timing, 1, kVarint);
    PutVarint(&timing, AsVarint(server_micros));
  }
  if (kernel_micros != 0) {
    PutTag(&timing, 2, kVarint);
    PutVarint(&timing, AsVarint(kernel_micros));
  }
  if (!timing.empty()) PutLengthField(&out, 5, timing);
  return out;
}

std::string ForwardRequestHead(const std::string& cache_id, int32_t layer,
                               const std::vector<SpanRef>& spans,
                               const ForwardOptionsRef& options) {
  std::string out;
  if (!cache_id.empty()) PutLengthField(&out, 1, cache_id);
  if (layer != 0) {
    PutTag(&out, 2, kVarint);
    PutVarint(&out, AsVarint(layer));
  }
  for (const SpanRef& s : spans) {
    std::string span;
    auto field = [&span](int n, uint64_t v) {
      if (v == 0) return;
      PutTag(&span, n, kVarint);
      PutVarint(&span, v);
    };
    field(1, s.seq_id);
    field(2, AsVarint(s.start));
    field(3, AsVarint(s.num_new_tokens));
    field(4, AsVarint(s.num_queries));
    PutLengthField(&out, 3, span);
  }
  std::string opts;
  if (options.causal.has_value()) {
    PutTag(&opts, 1, kVarint);
    PutVarint(&opts, *options.causal ? 1 : 0);
  }
  if (options.sm_scale.has_value()) {
    PutTag(&opts, 2, kFixed32);
    uint32_t bits;
    std::memcpy(&bits, &*options.sm_scale, 4);
    for (int i = 0; i < 4; ++i) opts.push_back(static_cast<char>(bits >> (8 * i)));
  }
  if (options.return_lse) {
    PutTag(&opts, 3, kVarint);
    PutVarint(&opts, 1);
  }
  if (!opts.empty()) PutLengthField(&out, 7, opts);
  return out;
}

}  // namespace pagedattn::wire
