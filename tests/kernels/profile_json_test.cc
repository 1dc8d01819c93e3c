// pagedattn-bench --profile's output (kernels/bench/profile_json.h) from stamps laid out as the
// kernels write them: regions, events, blocks in grid order, missing stamps. No GPU.
#include "kernels/bench/profile_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/device/profile_layout.h"

namespace pagedattn::kernels {
namespace {

namespace pf = profile;
using ::testing::HasSubstr;

class Stamps {
 public:
  Stamps() : values_(static_cast<size_t>(pf::kSlots) * pf::kEvents, 0) {}
  // Block b of region r stamped event e at t ns.
  void Set(int r, int b, int e, uint64_t t) {
    values_[(static_cast<size_t>(r) * pf::kRegionSlots + b) * pf::kEvents + e] = t;
  }
  const std::vector<uint64_t>& values() const { return values_; }

 private:
  std::vector<uint64_t> values_;
};

constexpr uint64_t kT0 = 5'000'000'000ull;  // a global timer's value, ns

TEST(ProfileJson, BlocksInGridOrderFromTheFirstStamp) {
  Stamps s;
  for (int b = 0; b < 3; ++b) {
    for (int e = 0; e < pf::kEvents; ++e) s.Set(pf::kDecodeTiles, b, e, kT0 + 1000 * b + 250 * e);
  }
  std::string summary;
  const std::string js = ProfileJson("\"case\": 7", s.values(), &summary);
  EXPECT_EQ(js.rfind("{\"case\": 7, \"units\": ", 0), 0u) << js;
  EXPECT_THAT(js,
              HasSubstr("\"decode_tiles\": {\"events\": [\"entry\", \"first tile landed\", "
                        "\"last tile done\", \"exit\"], \"blocks\": [[0.000, 0.250, 0.500, 0.750], "
                        "[1.000, 1.250, 1.500, 1.750], [2.000, 2.250, 2.500, 2.750]]}"));
  // Regions without a stamp are left out.
  EXPECT_EQ(js.find("decode_wide_tiles"), std::string::npos) << js;
  EXPECT_EQ(js.find("merge"), std::string::npos) << js;
  EXPECT_EQ(summary,
            "decode_tiles (3 blocks): entry 0.00 / 1.00 / 2.00; first tile landed 0.25 / 1.25 / "
            "2.25; last tile done 0.50 / 1.50 / 2.50; exit 0.75 / 1.75 / 2.75; (us: first / "
            "median / last block)\n");
}

TEST(ProfileJson, MissingStampsAreNullAndTheMergeHasThreeEvents) {
  Stamps s;
  s.Set(pf::kDecodeWideTiles, 0, pf::kTileEntry, kT0 + 2000);
  s.Set(pf::kDecodeWideTiles, 2, pf::kTileExit, kT0 + 9000);  // block 1 never stamped
  s.Set(pf::kMerge, 0, pf::kMergeEntry, kT0);
  s.Set(pf::kMerge, 0, pf::kMergeWaited, kT0 + 8000);
  s.Set(pf::kMerge, 0, pf::kMergeExit, kT0 + 10500);
  std::string summary;
  const std::string js = ProfileJson("\"case\": 0", s.values(), &summary);
  EXPECT_THAT(js,
              HasSubstr("\"decode_wide_tiles\": {\"events\": [\"entry\", \"first tile landed\", "
                        "\"last tile done\", \"exit\"], \"blocks\": [[2.000, null, null, null], "
                        "[null, null, null, null], [null, null, null, 9.000]]}"));
  EXPECT_THAT(js,
              HasSubstr("\"merge\": {\"events\": [\"entry\", \"tiles done (griddepcontrol.wait)\", "
                        "\"exit\"], \"blocks\": [[0.000, 8.000, 10.500]]}"));
  EXPECT_EQ(js.find("decode_tiles\""), std::string::npos) << js;
  EXPECT_THAT(summary,
              HasSubstr("decode_wide_tiles (3 blocks): entry 2.00 / 2.00 / 2.00; exit 9.00 / "
                        "9.00 / 9.00;"));
  EXPECT_THAT(summary,
              HasSubstr("merge (1 blocks): entry 0.00 / 0.00 / 0.00; tiles done "
                        "(griddepcontrol.wait) 8.00 / 8.00 / 8.00; exit 10.50 / 10.50 / 10.50;"));
}

TEST(ProfileJson, PrefillJobsTakeTheirOwnEventNames) {
  Stamps s;
  s.Set(pf::kPrefillJobs, 1, pf::kTileEntry, kT0);
  s.Set(pf::kPrefillJobs, 1, pf::kFirstTileLanded, kT0 + 1500);
  s.Set(pf::kPrefillJobs, 1, pf::kLastTileDone, kT0 + 90000);
  s.Set(pf::kPrefillJobs, 1, pf::kTileExit, kT0 + 91250);
  std::string summary;
  const std::string js = ProfileJson("\"case\": 2", s.values(), &summary);
  EXPECT_THAT(js,
              HasSubstr("\"prefill_jobs\": {\"events\": [\"start\", \"first tile landed\", "
                        "\"last tile done\", \"rows written\"], \"blocks\": [[null, null, null, "
                        "null], [0.000, 1.500, 90.000, 91.250]]}"));
  EXPECT_EQ(summary.rfind("prefill_jobs (2 blocks): start 0.00 / 0.00 / 0.00;", 0), 0u) << summary;
}

TEST(ProfileJson, NoStampsNoKernels) {
  Stamps s;
  std::string summary;
  EXPECT_EQ(ProfileJson("\"case\": 1", s.values(), &summary),
            "{\"case\": 1, \"units\": \"us from the launch's first stamp\", \"kernels\": {}}");
  EXPECT_EQ(summary, "");
}

}  // namespace
}  // namespace pagedattn::kernels
