// MemoryRegistry without a GPU: a backend whose ImportMemory hands out host buffers, counting
// what is mapped and unmapped. Bounds, alignment, ownership, leases (swept at chosen times),
// pins that outlive an unregistration, and one mapping per handle.
#include "server/core/memory_registry.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"

namespace pagedattn {
namespace {

int g_mapped = 0;  // mappings alive

class HostMemory final : public ImportedMemory {
 public:
  explicit HostMemory(int64_t size) : bytes_(static_cast<size_t>(size)) { ++g_mapped; }
  ~HostMemory() override { --g_mapped; }
  char* base() const override { return const_cast<char*>(bytes_.data()); }
  int64_t size() const override { return static_cast<int64_t>(bytes_.size()); }

 private:
  std::vector<char> bytes_;
};

// Handles are "<size>" in decimal; "bad" fails to open.
class FakeBackend final : public Backend {
 public:
  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string name() const override { return "fake"; }
  std::string device_name() const override { return "fake"; }
  int device_count() const override { return 1; }
  absl::StatusOr<MemoryInfo> memory(int) const override { return MemoryInfo{}; }
  absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry&,
                                                       const StopToken&) override {
    return absl::UnimplementedError("");
  }
  absl::Status Forward(KvPool&, const CacheGeometry&, const ForwardPlan&,
                       const ForwardIO&) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<std::unique_ptr<ImportedMemory>> ImportMemory(int,
                                                               const std::string& handle) override {
    ++imports;
    if (handle == "bad") return absl::InvalidArgumentError("cannot open");
    return std::unique_ptr<ImportedMemory>(new HostMemory(std::stoll(handle)));
  }
  absl::StatusOr<std::unique_ptr<ImportedEvent>> ImportEvent(int,
                                                             const std::string& handle) override {
    if (handle == "bad") return absl::InvalidArgumentError("cannot open");
    return std::unique_ptr<ImportedEvent>(new FakeEvent());
  }
  int imports = 0;

 private:
  class FakeEvent final : public ImportedEvent {
   public:
    void* handle() const override { return const_cast<FakeEvent*>(this); }
  };
};

class MemoryRegistryTest : public ::testing::Test {
 protected:
  MemoryRegistryTest()
      : registry_(&backend_, {.max_regions = 3,
                              .default_lease = absl::Seconds(60),
                              .sweep_interval = absl::Hours(1)}) {}

  RegionInfo Register(const std::string& cache, const std::string& owner = "a",
                      const std::string& handle = "4096", int64_t size = 4096,
                      absl::Duration lease = absl::ZeroDuration()) {
    absl::StatusOr<RegionInfo> r = registry_.Register({.owner = owner,
                                                       .cache_id = cache,
                                                       .device = 0,
                                                       .handle = handle,
                                                       .size_bytes = size,
                                                       .lease = lease,
                                                       .event_handles = {}});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : RegionInfo{};
  }
  absl::StatusCode ResolveCode(const std::string& id, int64_t offset, int64_t bytes,
                               const std::string& cache = "c1", const std::string& owner = "a") {
    std::vector<MemoryRegistry::Pin> pins;
    return registry_.Resolve(id, offset, bytes, cache, owner, "q", &pins).status().code();
  }

  FakeBackend backend_;
  MemoryRegistry registry_;
};

TEST_F(MemoryRegistryTest, ResolveChecksBoundsAlignmentCacheAndOwner) {
  const RegionInfo r = Register("c1", "a", "8192", 4096);
  EXPECT_EQ(r.size_bytes, 4096);
  EXPECT_EQ(r.lease, absl::Seconds(60));
  using C = absl::StatusCode;
  EXPECT_EQ(ResolveCode(r.id, 0, 4096), C::kOk);
  EXPECT_EQ(ResolveCode(r.id, 4096, 0), C::kOk);
  EXPECT_EQ(ResolveCode(r.id, 16, 4096), C::kInvalidArgument) << "past the registered size";
  EXPECT_EQ(ResolveCode(r.id, 4112, 0), C::kInvalidArgument);
  EXPECT_EQ(ResolveCode(r.id, 8, 16), C::kInvalidArgument) << "misaligned";
  EXPECT_EQ(ResolveCode(r.id, -16, 16), C::kInvalidArgument);
  EXPECT_EQ(ResolveCode(r.id, 16, INT64_MAX), C::kInvalidArgument) << "overflowing end";
  EXPECT_EQ(ResolveCode(r.id, 0, 16, "c2"), C::kInvalidArgument) << "another cache";
  EXPECT_EQ(ResolveCode(r.id, 0, 16, "c1", "b"), C::kNotFound) << "another owner";
  EXPECT_EQ(ResolveCode("nope", 0, 16), C::kNotFound);
  std::vector<MemoryRegistry::Pin> pins;
  absl::StatusOr<char*> a = registry_.Resolve(r.id, 32, 16, "c1", "a", "q", &pins);
  absl::StatusOr<char*> b = registry_.Resolve(r.id, 48, 16, "c1", "a", "q", &pins);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*b - *a, 16);
}

TEST_F(MemoryRegistryTest, RegisterChecksSizeLeaseHandleAndLimit) {
  using C = absl::StatusCode;
  auto code = [&](const std::string& handle, int64_t size, absl::Duration lease) {
    return registry_
        .Register({.owner = "a",
                   .cache_id = "c1",
                   .device = 0,
                   .handle = handle,
                   .size_bytes = size,
                   .lease = lease,
                   .event_handles = {}})
        .status()
        .code();
  };
  EXPECT_EQ(code("4096", 4097, absl::ZeroDuration()), C::kInvalidArgument) << "past the allocation";
  EXPECT_EQ(code("4096", 0, absl::ZeroDuration()), C::kInvalidArgument);
  EXPECT_EQ(code("4096", 16, absl::Milliseconds(10)), C::kInvalidArgument);
  EXPECT_EQ(code("4096", 16, absl::Hours(25)), C::kInvalidArgument);
  EXPECT_EQ(code("bad", 16, absl::ZeroDuration()), C::kInvalidArgument);
  for (int i = 0; i < 3; ++i) Register("c1");
  EXPECT_EQ(code("4096", 16, absl::ZeroDuration()), C::kResourceExhausted);
  EXPECT_EQ(registry_.size(), 3);
}

TEST_F(MemoryRegistryTest, OneMappingPerHandleAndPinsOutliveUnregistration) {
  const RegionInfo r1 = Register("c1");
  const RegionInfo r2 = Register("c2");  // the same allocation for another cache
  EXPECT_EQ(backend_.imports, 1);
  EXPECT_EQ(g_mapped, 1);
  std::vector<MemoryRegistry::Pin> pins;
  ASSERT_TRUE(registry_.Resolve(r1.id, 0, 16, "c1", "a", "q", &pins).ok());
  EXPECT_EQ(registry_.Unregister(r1.id, "b").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry_.Unregister(r1.id, "a").ok());
  ASSERT_TRUE(registry_.Unregister(r2.id, "a").ok());
  EXPECT_EQ(g_mapped, 1) << "unmapped under a Forward that still uses it";
  pins.clear();
  EXPECT_EQ(g_mapped, 0);
  EXPECT_EQ(registry_.Unregister(r1.id, "a").code(), absl::StatusCode::kNotFound);
}

TEST_F(MemoryRegistryTest, LeasesExpireUnlessUsedAndCacheDeletionReleases) {
  const absl::Time t0 = absl::Now();
  const RegionInfo idle = Register("c1", "a", "4096", 4096, absl::Seconds(2));
  const RegionInfo used = Register("c1", "a", "8192", 4096, absl::Seconds(2));
  const RegionInfo other = Register("c2", "a", "16384", 4096, absl::Seconds(60));
  EXPECT_EQ(registry_.Sweep(t0 + absl::Seconds(1)), 0);
  EXPECT_EQ(registry_.CountFor("c1"), 2);
  absl::SleepFor(absl::Milliseconds(1200));
  EXPECT_EQ(ResolveCode(used.id, 0, 16), absl::StatusCode::kOk);  // renews the lease now
  // A second on: idle is 2.2 s unused, past its lease; used 1 s.
  EXPECT_EQ(registry_.Sweep(absl::Now() + absl::Seconds(1)), 1);
  EXPECT_EQ(ResolveCode(idle.id, 0, 16), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveCode(used.id, 0, 16), absl::StatusCode::kOk);
  EXPECT_EQ(registry_.Sweep(absl::Now() + absl::Seconds(3)), 1);
  EXPECT_EQ(registry_.CountFor("c2"), 1);
  EXPECT_EQ(registry_.ReleaseCache("c2"), 1);
  EXPECT_EQ(ResolveCode(other.id, 0, 16, "c2"), absl::StatusCode::kNotFound);
  EXPECT_EQ(g_mapped, 0);
}

// --max_memory_regions=0 turns RegisterMemory off: refused as off, not as a limit reached.
TEST(MemoryRegistryOffTest, NoRegionsAllowedIsSaidSo) {
  FakeBackend backend;
  MemoryRegistry registry(&backend, {.max_regions = 0, .sweep_interval = absl::Hours(1)});
  const absl::Status s = registry
                             .Register({.owner = "a",
                                        .cache_id = "c",
                                        .device = 0,
                                        .handle = "4096",
                                        .size_bytes = 16,
                                        .lease = absl::ZeroDuration(),
                                        .event_handles = {}})
                             .status();
  EXPECT_FALSE(registry.enabled());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(s.message(),
            "RegisterMemory is off on this server (--max_memory_regions=0): send tensors as bytes");
}

// The registry's own sweeper releases a region once its lease has passed unused, telling
// on_release why; destroying the registry stops it.
TEST(MemoryRegistrySweeperTest, ReleasesAnExpiredRegionOnItsOwn) {
  FakeBackend backend;
  absl::Mutex mu;
  std::string why;
  {
    MemoryRegistry registry(&backend, {.max_regions = 3, .sweep_interval = absl::Milliseconds(20)},
                            [&](const RegionInfo&, const std::string& w) {
                              absl::MutexLock lock(&mu);
                              why = w;
                            });
    absl::StatusOr<RegionInfo> r = registry.Register({.owner = "a",
                                                      .cache_id = "c",
                                                      .device = 0,
                                                      .handle = "4096",
                                                      .size_bytes = 4096,
                                                      .lease = absl::Seconds(1),
                                                      .event_handles = {}});
    ASSERT_TRUE(r.ok()) << r.status();
    for (int i = 0; i < 250 && registry.CountFor("c") > 0; ++i) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(registry.CountFor("c"), 0);
  }
  absl::MutexLock lock(&mu);
  EXPECT_EQ(why, "unused for its whole lease");
}

TEST_F(MemoryRegistryTest, EventsAreNamedByOneBasedIndex) {
  absl::StatusOr<RegionInfo> r = registry_.Register({.owner = "a",
                                                     .cache_id = "c1",
                                                     .device = 0,
                                                     .handle = "4096",
                                                     .size_bytes = 4096,
                                                     .lease = absl::ZeroDuration(),
                                                     .event_handles = {"e1", "e2"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_events, 2);
  std::vector<MemoryRegistry::Pin> pins;
  absl::StatusOr<void*> e1 = registry_.ResolveEvent(r->id, 1, "c1", "a", "wait_event", &pins);
  absl::StatusOr<void*> e2 = registry_.ResolveEvent(r->id, 2, "c1", "a", "done_event", &pins);
  ASSERT_TRUE(e1.ok() && e2.ok());
  EXPECT_NE(*e1, *e2);
  using C = absl::StatusCode;
  EXPECT_EQ(registry_.ResolveEvent(r->id, 0, "c1", "a", "wait_event", &pins).status().code(),
            C::kInvalidArgument);
  EXPECT_EQ(registry_.ResolveEvent(r->id, 3, "c1", "a", "wait_event", &pins).status().code(),
            C::kInvalidArgument);
  EXPECT_EQ(registry_.ResolveEvent(r->id, 1, "c2", "a", "wait_event", &pins).status().code(),
            C::kInvalidArgument);
  EXPECT_EQ(registry_.ResolveEvent(r->id, 1, "c1", "b", "wait_event", &pins).status().code(),
            C::kNotFound);
  EXPECT_EQ(registry_
                .Register({.owner = "a",
                           .cache_id = "c1",
                           .device = 0,
                           .handle = "4096",
                           .size_bytes = 16,
                           .lease = absl::ZeroDuration(),
                           .event_handles = {"e1", "bad"}})
                .status()
                .code(),
            C::kInvalidArgument);
}

TEST_F(MemoryRegistryTest, UnknownRegionIdsAreQuotedEscapedAndBounded) {
  // An id as received: escaped (no control bytes, no UTF-8 cut in half) and cut to 64 bytes with
  // its length, as a cache id is; an empty one is a missing field, not an unknown region.
  const std::string hostile = "a\n" + std::string(100, 'x') + "\xc3\xa9";
  const absl::Status unregister = registry_.Unregister(hostile, "a");
  EXPECT_EQ(unregister.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unregister.message(),
            "memory region 'a\\n" + std::string(62, 'x') + "...(104 bytes)' is not registered");
  std::vector<MemoryRegistry::Pin> pins;
  const absl::StatusOr<char*> resolved =
      registry_.Resolve("\x1b[31m", 0, 16, "c1", "a", "q", &pins);
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(resolved.status().message(), "region_id '\\x1b[31m'"))
      << resolved.status();
  const absl::Status empty = registry_.Unregister("", "a");
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(empty.message(), "region_id is required (RegisterMemory gives it)");
  EXPECT_EQ(registry_.Resolve("", 0, 16, "c1", "a", "q", &pins).status().message(),
            "q.device_buffer.region_id is required (RegisterMemory gives it)");
}

}  // namespace
}  // namespace pagedattn
