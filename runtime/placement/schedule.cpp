// The list scheduler's run (schedule.h): tasks started in time order, each on its resource.
#include "runtime/placement/schedule.h"

#include <functional>
#include <limits>
#include <queue>

namespace strata::placement_detail {

void Schedule::run() {
  // Per resource: tasks whose dependencies ended, by the time they became ready (pending),
  // and those ready by the time the resource is free, by priority (available). A resource
  // serves the best available task when it is free, else, idle, the best of those ready
  // when the first pending one is.
  // O(tasks log tasks): a placement of hundreds of layers simulates hundreds of times.
  using Entry = std::pair<double, long>;  // (ready or priority, task)
  using MinHeap = std::priority_queue<Entry, std::vector<Entry>, std::greater<>>;
  std::vector<MinHeap> pending(kResources), available(kResources);
  double free_at[kResources] = {};
  auto make_ready = [&](int id) {
    const Task& t = task(id);
    pending[static_cast<std::size_t>(t.resource)].emplace(t.ready, id);
  };
  for (std::size_t i = 0; i < tasks_.size(); ++i) {
    if (tasks_[i].unmet == 0) make_ready(static_cast<int>(i));
  }
  // Moves `r`'s pending tasks ready by `time` to its available ones.
  auto release = [&](int r, double time) {
    auto& p = pending[static_cast<std::size_t>(r)];
    while (!p.empty() && p.top().first <= time) {
      const long id = p.top().second;
      p.pop();
      available[static_cast<std::size_t>(r)].emplace(task(static_cast<int>(id)).priority, id);
    }
  };
  for (std::size_t done = 0; done < tasks_.size(); ++done) {
    int best_r = -1;
    double best_start = std::numeric_limits<double>::infinity();
    long best_priority = 0;
    for (int r = 0; r < kResources; ++r) {
      release(r, free_at[r]);
      auto& a = available[static_cast<std::size_t>(r)];
      auto& p = pending[static_cast<std::size_t>(r)];
      double start = free_at[r];
      long priority = 0;
      if (!a.empty()) {
        priority = a.top().first;
      } else if (!p.empty()) {  // idle until its first pending task is ready
        start = p.top().first;
        priority = task(static_cast<int>(p.top().second)).priority;
      } else {
        continue;
      }
      if (start < best_start || (start == best_start && priority < best_priority)) {
        best_start = start;
        best_r = r;
        best_priority = priority;
      }
    }
    if (best_r < 0) return;  // a cycle: cannot happen with the graphs built below
    release(best_r, best_start);
    auto& a = available[static_cast<std::size_t>(best_r)];
    const int id = static_cast<int>(a.top().second);
    a.pop();
    Task& t = tasks_[static_cast<std::size_t>(id)];
    t.start = best_start;
    t.end = best_start + t.duration;
    free_at[best_r] = t.end;
    busy_[best_r] += t.duration;
    for (int d : t.dependents) {
      Task& u = tasks_[static_cast<std::size_t>(d)];
      u.ready = std::max(u.ready, t.end);
      if (--u.unmet == 0) make_ready(d);
    }
  }
}

}  // namespace strata::placement_detail
