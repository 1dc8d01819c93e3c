// The C++ client against a pagedattn-server process that starts after it, or is killed and
// started again on the same port: calls are answered again within a backoff step of the
// server's start. (A server in the test's own process does not show what a process does: its
// shutdown says goodbye, and its threads keep the client's channel polled.)
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "tests/service/child_process.h"

namespace pagedattn {
namespace {

// A loopback port free now (the kernel's pick for a socket bound and closed).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

class ReconnectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = std::getenv("PAGEDATTN_SERVER_BIN") ? std::getenv("PAGEDATTN_SERVER_BIN") : "";
    if (bin_.empty()) GTEST_SKIP() << "PAGEDATTN_SERVER_BIN is not set (ctest sets it)";
    port_ = FreePort();
    ASSERT_GT(port_, 0);
  }
  void TearDown() override { Kill(); }

  void StartServer() {
    std::vector<std::string> args = {bin_, "--backend=cpu", absl::StrCat("--listen=127.0.0.1:", port_),
                                     "--health_listen=", "--log_level=warn"};
    pid_ = SpawnProcess(std::move(args));
  }
  void Kill() { StopProcess(pid_, SIGKILL); }

  // Calls every 50 ms through `down` (each UNAVAILABLE), starts the server, and calls until it
  // answers: how long after the start that took.
  absl::Duration AnsweredAfterStart(Client& client, absl::Duration down) {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < down) {
      EXPECT_EQ(client.GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
      absl::SleepFor(absl::Milliseconds(50));
    }
    StartServer();
    const absl::Time started = absl::Now();
    absl::Status last;
    while (!(last = client.GetServerInfo().status()).ok() &&
           absl::Now() - started < absl::Seconds(30)) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_TRUE(last.ok()) << last;
    return absl::Now() - started;
  }

  std::string bin_;
  int port_ = -1;
  pid_t pid_ = -1;
};

// Debian's gRPC (1.51) with the target resolved no more than every 30 s answered 5 s after a
// server that started 30 ms after the client, and 9-10 s after a restart (common/transport.h).
TEST_F(ReconnectTest, AnsweredSoonAfterTheServerStartsAndRestarts) {
  ClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", port_);
  o.timeout = absl::Seconds(5);
  std::unique_ptr<Client> client = *Client::Connect(o);
  const absl::Duration first = AnsweredAfterStart(*client, absl::Milliseconds(100));
  EXPECT_LT(first, absl::Seconds(3));
  Kill();
  const absl::Duration again = AnsweredAfterStart(*client, absl::Seconds(1));
  EXPECT_LT(again, absl::Seconds(3));
  std::cout << "answered " << first << " after the start, " << again << " after the restart\n";
}

}  // namespace
}  // namespace pagedattn
