// The discrete-event list scheduler that the placement's step model (predict_step.cpp) runs
// its task graph on. One job: timing tasks on single-server resources; which tasks a step has is
// predict_step.cpp's. Private to runtime/placement/.
//
// Each task runs on one resource for a fixed time once its dependencies have ended. A resource
// serves, whenever it is free, the ready task with the lowest priority value (the order the
// runtime issues work in); idle, the first task to become ready. Picking the task with the earliest
// possible start over all resources keeps time moving forward, so a request issued later never
// overtakes one issued earlier.
#pragma once

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <utility>
#include <vector>

namespace strata::placement_detail {

enum Resource : int { kCompute, kH2d, kD2h, kDisk, kCpu, kResources };

struct Task {
  int resource = kCompute;
  double duration = 0;
  long priority = 0;
  std::vector<int> dependents;
  int unmet = 0;
  double ready = 0, start = -1, end = -1;
};

class Schedule {
 public:
  int add(int resource, double duration, long priority, std::initializer_list<int> deps) {
    const int id = static_cast<int>(tasks_.size());
    Task t;
    t.resource = resource;
    t.duration = std::max(0.0, duration);
    t.priority = priority;
    tasks_.push_back(std::move(t));
    for (int d : deps) depend(id, d);
    return id;
  }
  // `task` starts only after `on` ends (-1: nothing).
  void depend(int task, int on) {
    if (on < 0) return;
    tasks_[static_cast<std::size_t>(on)].dependents.push_back(task);
    ++tasks_[static_cast<std::size_t>(task)].unmet;
  }
  // Runs every task, setting its start and end and each resource's busy time.
  void run();
  const Task& task(int id) const { return tasks_[static_cast<std::size_t>(id)]; }
  double end(int id) const { return id < 0 ? 0 : task(id).end; }
  double busy(int r) const { return busy_[r]; }

 private:
  std::vector<Task> tasks_;
  double busy_[kResources] = {};
};

}  // namespace strata::placement_detail
