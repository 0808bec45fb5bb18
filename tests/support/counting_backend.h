// A device backend that wraps another (the host backend) and records every pin_host and
// unpin_host call: how the unit tests see what the DRAM arena and the host buffers pin.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/device/device_backend.h"

namespace strata_test {

class CountingBackend final : public strata::DeviceBackend {
 public:
  explicit CountingBackend(std::shared_ptr<strata::DeviceBackend> inner)
      : inner_(std::move(inner)) {}
  const strata::DeviceDescription& description() const override { return inner_->description(); }
  strata::Status allocate_device(uint64_t bytes, void** out) override {
    return inner_->allocate_device(bytes, out);
  }
  void free_device(void* ptr, uint64_t bytes) override { inner_->free_device(ptr, bytes); }
  strata::Status pin_host(void* ptr, uint64_t bytes) override {
    std::lock_guard lock(mutex);
    pins.push_back({ptr, bytes});
    return inner_->pin_host(ptr, bytes);
  }
  void unpin_host(void* ptr, uint64_t bytes) override {
    std::lock_guard lock(mutex);
    unpins.push_back({ptr, bytes});
    inner_->unpin_host(ptr, bytes);
  }
  strata::Status submit_copy(strata::CopyRequest request,
                             std::shared_ptr<strata::DeviceFence>* fence) override {
    return inner_->submit_copy(std::move(request), fence);
  }
  strata::Status copy_sync(void* dst, const void* src, uint64_t bytes) override {
    return inner_->copy_sync(dst, src, bytes);
  }
  strata::Status record_fence(void* stream, std::shared_ptr<strata::DeviceFence>* out) override {
    return inner_->record_fence(stream, out);
  }
  std::size_t shutdown() override { return inner_->shutdown(); }

  std::mutex mutex;
  std::vector<std::pair<void*, uint64_t>> pins, unpins;

 private:
  std::shared_ptr<strata::DeviceBackend> inner_;
};

// The host backend, wrapped.
inline std::shared_ptr<CountingBackend> counting_host_backend() {
  std::shared_ptr<strata::DeviceBackend> host;
  std::string reason;
  strata::DeviceOptions device;
  device.kind = strata::DeviceKind::kHost;
  if (!strata::create_device_backend(device, &host, &reason).is_ok()) return nullptr;
  return std::make_shared<CountingBackend>(host);
}

}  // namespace strata_test
