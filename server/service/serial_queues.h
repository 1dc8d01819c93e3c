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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "server/service/executor.h"

namespace pagedattn {

// Where a task waits its turn: under key, of group (whole_group: it conflicts with every task of
// the group); owner: whose turn on the executor it takes (a tenant).
struct QueueSlot {
  std::string owner, group, key;
  bool whole_group = false;
};

class SerialQueues {
 public:
  // The queues outlive executor's threads (a task ends in RunThenNext, here): destroy the
  // executor, which runs the tasks posted to it, first.
  explicit SerialQueues(Executor* executor) : executor_(executor) {}
  SerialQueues(const SerialQueues&) = delete;
  SerialQueues& operator=(const SerialQueues&) = delete;

  // Tasks must not throw (the queue's bookkeeping follows each). Runs task once every task of
  // its group posted before it that it conflicts with (under its key, or any of the group's if
  // either is whole_group) has run: on the calling thread before Run returns when here is true
  // and it may start at once (a CUDA Forward's milliseconds save a thread's wake-up; never under
  // a lock the task takes), else on the executor, in its owner's turn.
  void Run(QueueSlot slot, std::function<void()> task, bool here = false) {
    std::optional<Task> ready;
    {
      absl::MutexLock lock(&mu_);
      Group& g = groups_[slot.group];
      Task t{std::move(slot), std::move(task)};
      if (g.whole_running || !g.held.empty()) {
        g.held.push_back(std::move(t));  // after a whole-group task that runs or waits
      } else if (t.slot.whole_group) {
        if (g.active == 0) {
          StartWholeLocked(g, t);
          ready = std::move(t);
        } else {
          g.held.push_back(std::move(t));  // waits for the group's tasks before it
        }
      } else {
        ready = AdmitLocked(g, std::move(t));
      }
    }
    if (!ready.has_value()) return;
    if (here) {
      RunThenNext(*std::move(ready));
    } else {
      Post(*std::move(ready));
    }
  }

  // Keys with a task running or waiting.
  size_t busy_keys() const {
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<std::string> keys;
    for (const auto& [name, waiting] : keys_) keys.insert(name);
    for (const auto& [name, g] : groups_) {
      if (g.whole_running) keys.insert(g.whole_key);
      for (const Task& t : g.held) keys.insert(t.slot.key);
    }
    return keys.size();
  }

 private:
  struct Task {
    QueueSlot slot;
    std::function<void()> run;
  };
  // A group's tasks: `active` counts those admitted to their keys' queues (running or waiting
  // behind the one that runs); a whole-group task starts when none is, and while one runs or
  // waits for that, the tasks that come after it are `held`, in the order they came (the first,
  // when none runs, is a whole-group task).
  struct Group {
    int64_t active = 0;
    bool whole_running = false;
    std::string whole_key;  // of the one running
    std::deque<Task> held;
  };

  static void StartWholeLocked(Group& g, const Task& t) {
    g.whole_running = true;
    g.whole_key = t.slot.key;
  }

  // Admits t (a task of no whole group) to its key's queue: returned when it may start now.
  std::optional<Task> AdmitLocked(Group& g, Task t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++g.active;
    auto [key, idle] = keys_.try_emplace(t.slot.key);
    if (idle) return t;
    key->second.push_back(std::move(t));
    return std::nullopt;
  }

  void Post(Task t) {
    const std::string owner = t.slot.owner;
    executor_->Post([this, t = std::move(t)]() mutable { RunThenNext(std::move(t)); }, owner);
  }

  // Runs t, then starts what its end lets start on the executor (the thread goes back to the
  // queue of all keys: one key's long queue cannot keep it).
  void RunThenNext(Task t) {
    t.run();
    t.run = nullptr;  // what the task holds goes now, outside mu_
    std::vector<Task> ready;
    {
      absl::MutexLock lock(&mu_);
      auto it = groups_.find(t.slot.group);
      Group& g = it->second;
      if (t.slot.whole_group) {
        g.whole_running = false;
        g.whole_key.clear();
        // The tasks held behind it, in order, up to the next whole-group task.
        while (!g.held.empty() && !g.held.front().slot.whole_group) {
          std::optional<Task> next = AdmitLocked(g, std::move(g.held.front()));
          g.held.pop_front();
          if (next.has_value()) ready.push_back(*std::move(next));
        }
      } else {
        --g.active;
        // The key's next, admitted before (so counted in active).
        auto key = keys_.find(t.slot.key);
        if (key->second.empty()) {
          keys_.erase(key);
        } else {
          ready.push_back(std::move(key->second.front()));
          key->second.pop_front();
        }
      }
      // The whole-group task held first, once the tasks before it have all ended.
      if (!g.whole_running && g.active == 0 && !g.held.empty()) {
        StartWholeLocked(g, g.held.front());
        ready.push_back(std::move(g.held.front()));
        g.held.pop_front();
      }
      if (g.active == 0 && !g.whole_running && g.held.empty()) groups_.erase(it);
    }
    for (Task& r : ready) Post(std::move(r));
  }

  Executor* const executor_;
  mutable absl::Mutex mu_;
  // A group is here while one of its tasks runs, is posted to run or waits; a key while one of
  // its tasks admitted runs or is posted to run, with those admitted behind it.
  absl::flat_hash_map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::deque<Task>> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
