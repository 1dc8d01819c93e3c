// A CUDA error that leaves the GPU's context unusable (a kernel's illegal address) makes the
// CUDA backend say so (Backend::Unrecoverable), which turns the server's health NOT_SERVING for
// good. A binary of its own: the test ruins its process's context on purpose.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"
#include "server/core/backend.h"
#include "server/core/cuda_backend.h"

namespace pagedattn {
namespace {

TEST(LostContextTest, AnIllegalAddressMakesTheBackendUnrecoverable) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU visible: the test needs one";
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  // The backend probes only the devices it has used: one Forward's buffers on GPU 0.
  ASSERT_TRUE((*backend)->AcquireForwardBuffers(0, 4096, 4096, 4096, 64).ok());
  EXPECT_EQ((*backend)->Unrecoverable(), "");

  // A bad input alone (an invalid copy) leaves the context as it was.
  EXPECT_NE(cudaMemcpy(nullptr, reinterpret_cast<void*>(uintptr_t{16}), 64, cudaMemcpyDefault),
            cudaSuccess);
  cudaGetLastError();
  EXPECT_EQ((*backend)->Unrecoverable(), "");

  // An append whose slots, rows and pool lie at no device address: the kernel faults.
  const auto bogus = reinterpret_cast<void*>(uintptr_t{256});
  kernels::AppendParams p;
  p.k = bogus;
  p.v = bogus;
  p.src_dtype = DType::kBFloat16;
  p.k_cache = bogus;
  p.v_cache = bogus;
  p.cache_dtype = DType::kBFloat16;
  p.slots = static_cast<const int64_t*>(bogus);
  p.num_tokens = 1;
  p.num_kv_heads = 1;
  p.head_dim = 128;
  p.page_size = 16;
  kernels::Launcher launcher(/*graph_launch=*/false);
  ASSERT_TRUE(kernels::LaunchAppendKv(p, nullptr, launcher).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);

  // Asked from another thread, as the server's watch thread asks it.
  std::string why;
  std::thread([&] { why = (*backend)->Unrecoverable(); }).join();
  EXPECT_NE(why.find("GPU 0"), std::string::npos) << why;
  EXPECT_NE(why.find("cudaErrorIllegalAddress"), std::string::npos) << why;
  EXPECT_NE(why.find("restart"), std::string::npos) << why;
}

}  // namespace
}  // namespace pagedattn
