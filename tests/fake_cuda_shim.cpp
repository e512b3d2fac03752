// A fake CUDA runtime for a CPU-only build of torch, loaded by tests/fake_cuda.py
// before torch is imported. It never allocates or computes: FakeTensorMode owns every
// `cuda` tensor (shape, dtype and device only). It supplies what a CPU-only build lacks
// for those tensors to pass through torch's C++ layers unchanged:
//
// * a CUDA DeviceGuardImpl (one device, one stream, events that are always complete),
//   used by the Python bindings (indexing, copy_) and the autograd engine;
// * CUDA hooks reporting one device, so at::accelerator (the autograd engine's stream
//   bookkeeping) sees CUDA as the accelerator.
//
// Nothing here can make a CPU/CUDA mix or a host read succeed: those are decided by
// FakeTensorMode and the process group, which this file does not touch.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
constexpr auto kCuda = c10::DeviceType::CUDA;

struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kCuda; }
  Device exchangeDevice(Device) const override { return Device(kCuda, 0); }
  Device getDevice() const override { return Device(kCuda, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  Stream exchangeStream(Stream) const override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void** event, const Stream&, const DeviceIndex, const c10::EventFlag) const override {
    static int completed;
    *event = &completed;
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

struct FakeCudaHooks final : at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isBuilt() const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard)

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCudaHooks)
}  // namespace at
