// common/cmdline.h: which flags a command line repeats, read as absl reads argv, and the lines
// that name them.
#include "common/cmdline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"

ABSL_FLAG(std::string, cmdline_test_target, "", "a string flag of this test");
ABSL_FLAG(bool, cmdline_test_verbose, false, "a boolean flag of this test");
ABSL_FLAG(int64_t, cmdline_test_count, 0, "an integer flag of this test");

namespace pagedattn {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

const std::map<std::string, bool> kFlags = {{"target", false}, {"verbose", true}};

std::map<std::string, std::vector<std::string>> Repeated(std::vector<std::string> args) {
  args.insert(args.begin(), "program");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return RepeatedFlags(static_cast<int>(argv.size()), argv.data(), kFlags);
}

TEST(RepeatedFlags, EachFormAbslTakes) {
  EXPECT_THAT(Repeated({"--target=a", "-target=b", "--target", "c"}),
              ElementsAre(Pair("target", ElementsAre("a", "b", "c"))));
  // A boolean takes no separate value: "cmd" is a positional argument, not --verbose's.
  EXPECT_THAT(Repeated({"--verbose", "cmd", "--noverbose"}),
              ElementsAre(Pair("verbose", ElementsAre("", ""))));
}

TEST(RepeatedFlags, OnceEachOrAfterTheEndOfFlagsIsNoRepeat) {
  EXPECT_THAT(Repeated({"--target=a", "--verbose", "list", "id"}), IsEmpty());
  EXPECT_THAT(Repeated({"--target=a", "--", "--target=b"}), IsEmpty());
  // "--notarget" is not a string flag's negation, and unknown flags are absl's to refuse.
  EXPECT_THAT(Repeated({"--target=a", "--notarget", "--other=1", "--other=2"}), IsEmpty());
  // The value of a string flag may look like a flag.
  EXPECT_THAT(Repeated({"--target", "--verbose", "--verbose"}), IsEmpty());
}

TEST(RepeatedFlags, ErrorsNameTheFlagAndHideSecretValues) {
  const std::map<std::string, std::vector<std::string>> repeated = {
      {"target", {"a:1", "b:2"}}, {"token", {"s3cret", "other"}}};
  EXPECT_THAT(RepeatedFlagErrors(repeated, {"token"}),
              ElementsAre("--target is given 2 times (a:1, b:2); give it once",
                          "--token is given 2 times; give it once"));
}

TEST(RepeatedFlags, FlagKindsAreTheFileOwnFlags) {
  const std::map<std::string, bool> kinds = FlagKinds(absl::GetAllFlags(), "cmdline_test.cc");
  EXPECT_THAT(kinds,
              ElementsAre(Pair("cmdline_test_count", false), Pair("cmdline_test_target", false),
                          Pair("cmdline_test_verbose", true)));
}

std::vector<std::string> Unparsable(std::vector<std::string> args) {
  args.insert(args.begin(), "program");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return UnparsableFlags(
      static_cast<int>(argv.size()), argv.data(),
      ProgramFlags(absl::GetAllFlags(), "cmdline_test.cc"),
      [](absl::string_view name) { return absl::FindCommandLineFlag(name) != nullptr; });
}

TEST(UnparsableFlags, EachBadNameAndValueIsNamed) {
  EXPECT_THAT(
      Unparsable({"--cmdline_test_count=x", "--cmdline_test_verbose=maybe",
                  "--cmdline_test_cuont=1", "--nocmdline_test_verbose=1", "--cmdline_test_count"}),
      ElementsAre("--cmdline_test_count must be an integer (got 'x')",
                  "--cmdline_test_verbose must be true or false (got 'maybe')",
                  "unknown flag --cmdline_test_cuont (see --help)",
                  "--nocmdline_test_verbose takes no value (--cmdline_test_verbose=false)",
                  "--cmdline_test_count needs a value (--cmdline_test_count=VALUE)"));
  // A negative number is taken for a flag by absl's parser: named as what it is.
  EXPECT_THAT(Unparsable({"-1", "--2.5"}),
              ElementsAre("-1: no argument is negative, and a word that starts with - is read "
                          "as a flag (see --help)",
                          "-2.5: no argument is negative, and a word that starts with - is read "
                          "as a flag (see --help)"));
  // --help and --version are answered bare: with a value they are not "unknown".
  EXPECT_THAT(
      Unparsable({"--help=foo", "--version=1", "--helpfull=x", "-h=1"}),
      ElementsAre("--help takes no value (--help alone)",
                  "--version takes no value (--version alone)",
                  "--helpfull takes no value (--helpfull alone)", "-h takes no value (-h alone)"));
  // Every form absl takes; after "--" nothing is a flag.
  EXPECT_THAT(Unparsable({"--cmdline_test_count", "3", "-cmdline_test_target=a",
                          "--nocmdline_test_verbose", "cmd", "--", "--nonsense"}),
              IsEmpty());
  EXPECT_EQ(absl::GetFlag(FLAGS_cmdline_test_count), 3);  // set as absl would set it
}

}  // namespace
}  // namespace pagedattn
