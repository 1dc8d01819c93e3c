// SerialQueues: tasks in queues by key over one Executor. Tasks posted under one key run one at a
// time, in the order posted; tasks of different keys run at once, on the executor's threads. A
// task waiting for its turn holds no thread: calls queued on one layer of a cache (keyed by
// cache and layer) leave the threads to every other cache and layer. Where a waiting call held a
// thread, 16 Forwards queued on one layer behind a 5 s Forward held another tenant's Forward
// 5.4 s on the CPU backend.
//
// Keys belong to groups (a cache), and a task posted with `whole_group` (a release, which needs
// the cache's layers quiet) conflicts with every task of its group. Within a group a task starts
// once every task posted before it that it conflicts with has ended (the same key, or either of
// the two whole-group), so a group's tasks keep the order they came in wherever it matters: a
// release runs after the Forwards posted before it, queued ones included, and before those
// posted after it. Held back, a task holds no thread: a release behind a long Forward holds
// none, nor do the calls behind the release.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "server/service/executor.h"

namespace pagedattn {

class SerialQueues {
 public:
  // The queues outlive executor's threads (a task ends in RunThenNext, here): destroy the
  // executor, which runs the tasks posted to it, first.
  explicit SerialQueues(Executor* executor) : executor_(executor) {}
  SerialQueues(const SerialQueues&) = delete;
  SerialQueues& operator=(const SerialQueues&) = delete;

  // Tasks must not throw (the queue's bookkeeping follows each). Runs task once every task of
  // group posted before it that it conflicts with (under key, or any of group's if either is
  // whole_group) has run: on the calling thread before Run returns when here is true and it may
  // start at once (a CUDA Forward's milliseconds save a thread's wake-up; never under a lock the
  // task takes), else on the executor.
  void Run(const std::string& group, const std::string& key, std::function<void()> task,
           bool here = false, bool whole_group = false) {
    std::vector<Task> ready;
    {
      absl::MutexLock lock(&mu_);
      Group& g = groups_[group];
      g.pending.push_back(Task{group, key, std::move(task), whole_group});
      StartLocked(g, ready);  // at most the new task: nothing else changed
    }
    // (ready holds the new task or nothing: the others waited for what still runs.)
    for (size_t i = 0; i < ready.size(); ++i) {
      if (here && i + 1 == ready.size()) {
        RunThenNext(std::move(ready[i]));
      } else {
        Post(std::move(ready[i]));
      }
    }
  }

  // Keys with a task running or waiting.
  size_t busy_keys() const {
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<std::string> keys;
    for (const auto& [name, g] : groups_) {
      keys.insert(g.running_keys.begin(), g.running_keys.end());
      for (const Task& t : g.pending) keys.insert(t.key);
    }
    return keys.size();
  }

 private:
  struct Task {
    std::string group, key;
    std::function<void()> run;
    bool whole_group = false;
  };
  // A group's running tasks (by key; a whole-group task runs alone) and those not started, in
  // the order they came.
  struct Group {
    absl::flat_hash_set<std::string> running_keys;
    bool whole_running = false;
    std::deque<Task> pending;
  };

  // Moves the tasks of g that may start now from g.pending to ready: in order, each that
  // conflicts with no running task and no earlier pending one.
  static void StartLocked(Group& g, std::vector<Task>& ready) {
    absl::flat_hash_set<std::string> blocked;  // keys of pending tasks passed over
    for (auto it = g.pending.begin(); it != g.pending.end() && !g.whole_running;) {
      if (it->whole_group) {
        // Alone, and after every task before it: nothing after it may start either.
        if (it == g.pending.begin() && g.running_keys.empty()) {
          g.whole_running = true;
          ready.push_back(std::move(*it));
          g.pending.erase(it);
        }
        return;
      }
      if (g.running_keys.contains(it->key) || blocked.contains(it->key)) {
        blocked.insert(it->key);
        ++it;
        continue;
      }
      g.running_keys.insert(it->key);
      ready.push_back(std::move(*it));
      it = g.pending.erase(it);
    }
  }

  void Post(Task t) {
    executor_->Post([this, t = std::move(t)]() mutable { RunThenNext(std::move(t)); });
  }

  // Runs t, then starts what its end lets start on the executor (the thread goes back to the
  // queue of all keys: one key's long queue cannot keep it).
  void RunThenNext(Task t) {
    t.run();
    t.run = nullptr;  // what the task holds goes now, outside mu_
    std::vector<Task> ready;
    {
      absl::MutexLock lock(&mu_);
      auto it = groups_.find(t.group);
      Group& g = it->second;
      if (t.whole_group) {
        g.whole_running = false;
      } else {
        g.running_keys.erase(t.key);
      }
      StartLocked(g, ready);
      if (g.running_keys.empty() && !g.whole_running && g.pending.empty()) groups_.erase(it);
    }
    for (Task& r : ready) Post(std::move(r));
  }

  Executor* const executor_;
  mutable absl::Mutex mu_;
  // A group is here while one of its tasks runs, is posted to run or waits.
  absl::flat_hash_map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
