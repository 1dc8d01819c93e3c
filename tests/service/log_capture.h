// What a running server logs during part of a test, captured without swapping spdlog's default
// logger under the server's threads: spdlog hands its default logger to readers as a raw pointer
// with no synchronization, so a logger installed while handler threads run (or reinstalled
// before their last lines) races with them (ThreadSanitizer reports it). Instead the default
// logger is replaced once, before any test runs (a global test environment), by one that writes
// through a distributing sink; a LogCapture adds its own sink to that (under the sink's mutex)
// and lowers the level (an atomic) for its lifetime.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <string>

#include "spdlog/sinks/base_sink.h"
#include "spdlog/sinks/dist_sink.h"
#include "spdlog/spdlog.h"

namespace pagedattn::testing {

// The default logger's sinks behind one distributing sink (installed by the environment below).
inline std::shared_ptr<spdlog::sinks::dist_sink_mt> TestLogSinks() {
  static const std::shared_ptr<spdlog::sinks::dist_sink_mt> sinks = [] {
    std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
    auto dist = std::make_shared<spdlog::sinks::dist_sink_mt>(previous->sinks());
    auto logger = std::make_shared<spdlog::logger>(previous->name(), dist);
    logger->set_level(previous->level());
    spdlog::set_default_logger(logger);
    return dist;
  }();
  return sinks;
}

class TestLogEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { TestLogSinks(); }
};
inline ::testing::Environment* const kTestLogEnvironment =
    ::testing::AddGlobalTestEnvironment(new TestLogEnvironment);

// A sink that keeps its lines in a string, read under the same mutex its writes take (a
// handler's last line may still arrive while a test reads).
class StringSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string Text() {
    std::lock_guard<std::mutex> lock(mutex_);
    return text_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    text_.append(formatted.data(), formatted.size());
  }
  void flush_() override {}

 private:
  std::string text_;
};

// Captures the default logger's lines at `level` and above while it lives.
class LogCapture {
 public:
  explicit LogCapture(spdlog::level::level_enum level)
      : sink_(std::make_shared<StringSink>()), previous_level_(spdlog::default_logger()->level()) {
    TestLogSinks()->add_sink(sink_);
    spdlog::default_logger()->set_level(level);
  }
  ~LogCapture() {
    spdlog::default_logger()->set_level(previous_level_);
    TestLogSinks()->remove_sink(sink_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  // What was captured so far.
  std::string str() { return sink_->Text(); }

 private:
  std::shared_ptr<StringSink> sink_;
  spdlog::level::level_enum previous_level_;
};

}  // namespace pagedattn::testing
