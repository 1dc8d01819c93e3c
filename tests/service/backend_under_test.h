// The backend the service suites run their servers on: the CPU backend, or the CUDA backend with
// PAGEDATTN_E2E_BACKEND=cuda on a GPU machine (kernels/bench/run_suite.sh runs them so there).
#pragma once

#include <cstdlib>
#include <string>

#include "server/core/backend_factory.h"

namespace pagedattn::testing {

// "cpu" (the default) or "cuda": what GetServerInfo's backend says.
inline std::string BackendUnderTest() {
  const char* b = std::getenv("PAGEDATTN_E2E_BACKEND");
  return b != nullptr && *b != '\0' ? b : "cpu";
}

inline bool OnCpu() { return BackendUnderTest() == "cpu"; }

// A server's backend options for it, with cpu_threads threads on the CPU backend.
inline BackendOptions BackendOptionsUnderTest(int cpu_threads) {
  return {.backend = OnCpu() ? BackendChoice::kCpu : BackendChoice::kCuda,
          .cpu_threads = cpu_threads};
}

}  // namespace pagedattn::testing
