// A device guard for CUDA in a CPU-only torch build, so fake CUDA tensors (FakeTensorMode) can be
// indexed and copied: torch's Python bindings open a guard on a tensor's device before
// dispatching, and a CPU build has none for CUDA. c10's FakeGuardImpl does nothing but
// remember a device index; no kernel ever runs on it (the fake tensors have no data).
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
