// ThreadSanitizer builds only: absl::Mutex and absl::CondVar made visible to TSan.
//
// The distribution's absl (and gRPC, which locks absl::Mutex too) is not built with TSan, so
// TSan cannot see that these locks order memory accesses and reports every access they guard
// as a race. This file interposes the exported lock and wait functions (the executable's
// definitions win over the shared library's, for every library's calls): each calls the
// library's own and tells TSan that it acquired or released the mutex.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#define ABSL_INTERNAL_TSAN_STR2(x) #x
#define ABSL_INTERNAL_TSAN_STR(x) ABSL_INTERNAL_TSAN_STR2(x)
#define ABSL_INTERNAL_TSAN_NS ABSL_INTERNAL_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME)

namespace {

// The library's own function, by its mangled name: "_ZN4absl" <inline namespace> <suffix>.
template <typename Fn>
Fn Real(const char* suffix) {
  const char* ns = ABSL_INTERNAL_TSAN_NS;
  const std::string mangled =
      std::string("_ZN4absl") + std::to_string(std::strlen(ns)) + ns + suffix;
  void* f = dlsym(RTLD_NEXT, mangled.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found: %s\n", mangled.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}

#define REAL(ret, suffix, ...) static const auto real = Real<ret (*)(__VA_ARGS__)>(suffix)

void Acquire(const void* mu) { __tsan_acquire(const_cast<void*>(mu)); }
void Release(const void* mu) { __tsan_release(const_cast<void*>(mu)); }

// A Condition is evaluated inside the library with the mutex held, by the waiter or by the
// thread that unlocks: the evaluation is made to acquire and release the mutex for TSan too.
struct Guarded {
  const absl::Condition* cond;
  const void* mu;
};
bool EvalGuarded(Guarded* g) {
  Acquire(g->mu);
  const bool result = g->cond->Eval();
  Release(g->mu);
  return result;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL(void, "5Mutex4LockEv", Mutex*);
  real(this);
  Acquire(this);
}
void Mutex::Unlock() {
  REAL(void, "5Mutex6UnlockEv", Mutex*);
  Release(this);
  real(this);
}
void Mutex::ReaderLock() {
  REAL(void, "5Mutex10ReaderLockEv", Mutex*);
  real(this);
  Acquire(this);
}
void Mutex::ReaderUnlock() {
  REAL(void, "5Mutex12ReaderUnlockEv", Mutex*);
  Release(this);
  real(this);
}
bool Mutex::TryLock() {
  REAL(bool, "5Mutex7TryLockEv", Mutex*);
  const bool ok = real(this);
  if (ok) Acquire(this);
  return ok;
}
bool Mutex::ReaderTryLock() {
  REAL(bool, "5Mutex13ReaderTryLockEv", Mutex*);
  const bool ok = real(this);
  if (ok) Acquire(this);
  return ok;
}
void Mutex::LockWhen(const Condition& cond) {
  REAL(void, "5Mutex8LockWhenERKNS0_9ConditionE", Mutex*, const Condition&);
  Guarded g{&cond, this};
  real(this, Condition(&EvalGuarded, &g));
  Acquire(this);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  REAL(bool, "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE",
       Mutex*, const Condition&, absl::Duration);
  Guarded g{&cond, this};
  const bool ok = real(this, Condition(&EvalGuarded, &g), timeout);
  Acquire(this);
  return ok;
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  REAL(bool, "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE", Mutex*,
       const Condition&, absl::Time);
  Guarded g{&cond, this};
  const bool ok = real(this, Condition(&EvalGuarded, &g), deadline);
  Acquire(this);
  return ok;
}
void Mutex::Await(const Condition& cond) {
  REAL(void, "5Mutex5AwaitERKNS0_9ConditionE", Mutex*, const Condition&);
  Release(this);
  Guarded g{&cond, this};
  real(this, Condition(&EvalGuarded, &g));
  Acquire(this);
}
bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  REAL(bool, "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE", Mutex*,
       const Condition&, absl::Duration);
  Release(this);
  Guarded g{&cond, this};
  const bool ok = real(this, Condition(&EvalGuarded, &g), timeout);
  Acquire(this);
  return ok;
}
bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  REAL(bool, "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE", Mutex*,
       const Condition&, absl::Time);
  Release(this);
  Guarded g{&cond, this};
  const bool ok = real(this, Condition(&EvalGuarded, &g), deadline);
  Acquire(this);
  return ok;
}
void CondVar::Wait(Mutex* mu) {
  REAL(void, "7CondVar4WaitEPNS0_5MutexE", CondVar*, Mutex*);
  Release(mu);
  real(this, mu);
  Acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  REAL(bool, "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE", CondVar*,
       Mutex*, absl::Duration);
  Release(mu);
  const bool ok = real(this, mu, timeout);
  Acquire(mu);
  return ok;
}
bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  REAL(bool, "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE", CondVar*,
       Mutex*, absl::Time);
  Release(mu);
  const bool ok = real(this, mu, deadline);
  Acquire(mu);
  return ok;
}

ABSL_NAMESPACE_END
}  // namespace absl
