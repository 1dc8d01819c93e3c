// SerialQueues: tasks in queues by key over one Executor. Tasks posted under one key run one at a
// time, in the order posted; tasks of different keys run at once, on the executor's threads. A
// task waiting for its turn holds no thread: calls queued on one layer of a cache (keyed by
// cache and layer) leave the threads to every other cache and layer. Where a waiting call held a
// thread, 16 Forwards queued on one layer behind a 5 s Forward held another tenant's Forward
// 5.4 s on the CPU backend.
//
// Keys belong to groups (a cache): a task posted with `whole_group` (a release, which needs the
// cache's layers quiet) runs when no task of its group runs, and while it waits for them the
// group's tasks that come after it wait for it (holding no thread, as a task waiting for its key
// does), so a release behind a long Forward holds one thread, not one per layer; a group's tasks
// pass its whole-group tasks in the order they came.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
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

  // Tasks must not throw (the queue's bookkeeping follows each). Runs task once every task posted
  // before it under key (whose tasks all belong to group) has run (and, whole_group, once the tasks
  // of group's other keys that started before it have ended): on the calling thread before Run
  // returns when here is true and it may start at once (a CUDA Forward's milliseconds save a
  // thread's wake-up; never under a lock the task takes), else on the executor.
  void Run(const std::string& group, const std::string& key, std::function<void()> task,
           bool here = false, bool whole_group = false) {
    Task t{group, key, std::move(task), whole_group};
    {
      absl::MutexLock lock(&mu_);
      auto [it, idle] = keys_.try_emplace(key);
      if (!idle) {  // one of key's is running or held back: this one waits behind it
        it->second.push_back(std::move(t));
        return;
      }
      if (!AdmitLocked(t)) return;  // held back by its group: started by the group's turn
    }
    Start(std::move(t), here);
  }

  // Keys with a task running, held back or waiting.
  size_t busy_keys() const {
    absl::MutexLock lock(&mu_);
    return keys_.size();
  }

 private:
  struct Task {
    std::string group, key;
    std::function<void()> run;
    bool whole_group = false;
  };
  // A group's tasks that run, and those waiting for the group in the order they came:
  // whole-group tasks, and the tasks of its keys that came while one of those waited or ran.
  struct Group {
    int64_t running = 0;
    bool whole_running = false;
    std::deque<Task> waiting;
  };

  // Whether t (its key's next) may start now; if not, it waits in its group's queue.
  bool AdmitLocked(Task& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Group& g = groups_[t.group];
    if (!g.whole_running && g.waiting.empty() && (!t.whole_group || g.running == 0)) {
      if (t.whole_group) {
        g.whole_running = true;
      } else {
        ++g.running;
      }
      return true;
    }
    g.waiting.push_back(std::move(t));
    return false;
  }

  void Start(Task t, bool here) {
    if (here) {
      RunThenNext(std::move(t));
    } else {
      executor_->Post([this, t = std::move(t)]() mutable { RunThenNext(std::move(t)); });
    }
  }

  // Runs t, then starts what its end lets start (its key's next, its group's held tasks) on the
  // executor (the thread goes back to the queue of all keys: one key's long queue cannot keep
  // it).
  void RunThenNext(Task t) {
    t.run();
    t.run = nullptr;  // what the task holds goes now, outside mu_
    std::vector<Task> ready;
    {
      absl::MutexLock lock(&mu_);
      // The group's turn.
      Group& g = groups_.find(t.group)->second;
      if (t.whole_group) {
        g.whole_running = false;
      } else {
        --g.running;
      }
      // In the order they came: the tasks up to the next whole-group one, then that one once
      // the group is quiet (a task waits only for the whole-group tasks that came before it).
      while (!g.whole_running && !g.waiting.empty()) {
        Task& w = g.waiting.front();
        if (w.whole_group) {
          if (g.running != 0) break;
          g.whole_running = true;
        } else {
          ++g.running;
        }
        ready.push_back(std::move(w));
        g.waiting.pop_front();
      }
      // The key's turn: its next task (of the same group), if the group lets it start now.
      auto key = keys_.find(t.key);
      if (key->second.empty()) {
        keys_.erase(key);
      } else {
        Task next = std::move(key->second.front());
        key->second.pop_front();
        if (AdmitLocked(next)) ready.push_back(std::move(next));
      }
      auto group = groups_.find(t.group);
      const Group& left = group->second;
      if (left.running == 0 && !left.whole_running && left.waiting.empty()) {
        groups_.erase(group);
      }
    }
    for (Task& r : ready) Start(std::move(r), /*here=*/false);
  }

  Executor* const executor_;
  mutable absl::Mutex mu_;
  // A key is here while one of its tasks runs, is posted to run or is held back by its group,
  // with those waiting behind it.
  absl::flat_hash_map<std::string, std::deque<Task>> keys_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
