// common/host_port.h: the addresses every flag and client target goes through.
#include "common/host_port.h"

#include <gtest/gtest.h>

namespace pagedattn {
namespace {

HostPort Parsed(std::string_view address) {
  HostPort hp;
  EXPECT_EQ(ParseHostPort(address, &hp), "") << address;
  return hp;
}

std::string Why(std::string_view address) {
  HostPort hp{"untouched", 7};
  const std::string why = ParseHostPort(address, &hp);
  EXPECT_EQ(hp.host, "untouched") << address;  // a refused address leaves *out as it was
  return why;
}

TEST(HostPortTest, ParsesEachForm) {
  EXPECT_EQ(Parsed("127.0.0.1:9464").host, "127.0.0.1");
  EXPECT_EQ(Parsed("127.0.0.1:9464").port, 9464);
  EXPECT_EQ(Parsed("[::1]:50051").host, "::1");
  EXPECT_EQ(Parsed("[::1]:50051").port, 50051);
  EXPECT_EQ(Parsed(":0").host, "");
  EXPECT_EQ(Parsed(":0").port, 0);
  EXPECT_EQ(Parsed("pagedattn-0.pagedattn:65535").port, 65535);
}

TEST(HostPortTest, RefusesWithTheReason) {
  EXPECT_EQ(Why("localhost"), "no :port");
  EXPECT_EQ(Why("::1:9464"), "an IPv6 address needs [brackets]");
  EXPECT_EQ(Why("[::1:9464"), "no closing ']'");
  EXPECT_EQ(Why("[::1]9464"), "no :port");
  EXPECT_EQ(Why("host:"), "the port is not a number");
  EXPECT_EQ(Why("host:+80"), "the port is not a number");
  EXPECT_EQ(Why("host:80x"), "the port is not a number");
  EXPECT_EQ(Why("host:123456"), "the port is not a number");
  EXPECT_EQ(Why("host:65536"), "the port is out of range");
  EXPECT_EQ(Why("my host:80"), "the host has a space or a control character");
  EXPECT_EQ(Why("host\n:80"), "the host has a space or a control character");
}

// A client's target is refused for a port gRPC would wrap (a dns: URI's too) or, plain, for not
// being host:port; a dns: name's port is otherwise gRPC's to read.
TEST(HostPortTest, TargetsPortChecked) {
  EXPECT_EQ(TargetPortError("localhost:99999"), "the port is out of range");
  EXPECT_EQ(TargetPortError("localhost:http"), "the port is not a number");
  EXPECT_EQ(TargetPortError("dns:localhost:99999"), "the port is out of range");
  EXPECT_EQ(TargetPortError("dns:///localhost:99999"), "the port is out of range");
  EXPECT_EQ(TargetPortError("dns://8.8.8.8:53/pagedattn-0.pagedattn:70000"),
            "the port is out of range");
  for (const char* fine : {"localhost:50051", "localhost", "dns:///localhost", "dns://resolver",
                           "dns:///localhost:1", "dns://8.8.8.8:53/pagedattn-0.pagedattn:50051",
                           "dns:///[::1]", "dns:[2001:db8::1]", "dns:///host:https", "unix:/tmp/s",
                           "unix:///tmp/s", "ipv4:127.0.0.1:1", "ipv6:[::1]:1", "xds:///svc"}) {
    EXPECT_EQ(TargetPortError(fine), "") << fine;
  }
}

TEST(HostPortTest, FormatsWhatItParses) {
  for (const char* address : {"127.0.0.1:9464", "[::1]:50051", ":0", "[fe80::1%eth0]:1"}) {
    EXPECT_EQ(FormatHostPort(Parsed(address)), address);
  }
}

}  // namespace
}  // namespace pagedattn
