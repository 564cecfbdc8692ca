// Host launch plans: replay a recorded sequence of kernel launches for new tensors, from C++.
//
// turbo_moe/host_plan.py records what one call of a hot region (an FP8 GEMM's forward or
// backward) does on the GPU -- the buffers it allocates, every kernel it launches with the exact
// bytes of each parameter -- and registers that as a plan. A later call with the same signature
// (shapes, strides, dtypes, alignment, recipe) calls replay(): one C++ call allocates the buffers
// from torch's caching allocator, copies each launch's parameter template, writes the current
// addresses into it (pointers, and the global-address field of each TMA descriptor), and calls
// cuLaunchKernel. The Python between the launches, which cost most of a layer's host time, is
// skipped; the kernels, their order, grids and parameters are the recorded ones.
//
// This file knows nothing of turbo_moe's kernels: a plan is bytes, offsets and sources. The CUDA
// driver is reached through dlopen (no CUDA headers or link at build time), and the build needs
// only torch's headers (torch.utils.cpp_extension, built on first use).
#include <torch/extension.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

// No C++ exception leaves this module: every entry point catches what its body throws and returns
// the message (empty on success) beside its result, and the Python side raises. An exception
// reaching pybind11's translator was seen crashing the process (SIGSEGV) on the sandboxed GPU
// machines, a plain std::runtime_error as well as a c10::Error.
template <typename... Args>
void check(bool ok, const Args&... parts) {
  if (!ok) {
    std::ostringstream message;
    message << "turbo_moe launch plans: ";
    (message << ... << parts);
    throw std::runtime_error(message.str());
  }
}

template <typename T, typename F>
std::tuple<std::string, T> guarded(F&& body) {
  try {
    return {std::string(), body()};
  } catch (const c10::Error& e) {
    return {e.what_without_backtrace(), T()};
  } catch (const std::exception& e) {
    return {e.what(), T()};
  } catch (...) {
    return {"turbo_moe launch plans: unknown C++ exception", T()};
  }
}

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
using GetErrorStringFn = CUresult (*)(CUresult, const char**);
using FuncGetParamInfoFn = CUresult (*)(CUfunction, size_t, size_t*, size_t*);

struct Driver {
  LaunchKernelFn launch = nullptr;
  GetErrorStringFn error_string = nullptr;
  FuncGetParamInfoFn param_info = nullptr;  // CUDA >= 12.4 drivers
};

const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      const char* why = dlerror();
      check(false, "cannot open libcuda.so.1: ", why != nullptr ? why : "unknown error");
    }
    d.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    d.error_string = reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    d.param_info = reinterpret_cast<FuncGetParamInfoFn>(dlsym(lib, "cuFuncGetParamInfo"));
    check(d.launch != nullptr && d.error_string != nullptr, "libcuda.so.1 lacks cuLaunchKernel/cuGetErrorString");
    return d;
  }();
  return loaded;
}

// A source of an address: an input tensor (index >= 0) or the plan's allocation -(index + 1).
struct Patch {
  int64_t at;      // byte position in the launch's parameter buffer (8 bytes are written)
  int64_t source;
  int64_t offset;  // bytes added to the source's data pointer
};

struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<uint8_t> params;  // the recorded parameter bytes, laid out at the driver's offsets
  std::vector<int64_t> param_offsets;
  std::vector<Patch> patches;
};

struct Output {
  int64_t source;
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset;  // in elements of dtype
};

struct Plan {
  int64_t num_inputs;
  std::vector<int64_t> alloc_bytes;
  std::vector<bool> alloc_zero;
  std::vector<Launch> launches;
  std::vector<Output> outputs;
};

std::mutex plans_mutex;
std::vector<std::shared_ptr<const Plan>> plans;

std::shared_ptr<const Plan> plan_at(int64_t id) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  check(id >= 0 && id < static_cast<int64_t>(plans.size()), "no plan ", id);
  return plans[id];
}

// (offset, size) of every parameter of a loaded kernel, from the driver; empty when the driver
// cannot say (then the caller does not make a plan).
std::vector<std::tuple<int64_t, int64_t>> param_info(int64_t function) {
  std::vector<std::tuple<int64_t, int64_t>> result;
  const Driver& d = driver();
  if (d.param_info == nullptr) return result;
  for (size_t i = 0;; ++i) {
    size_t offset = 0, size = 0;
    if (d.param_info(reinterpret_cast<CUfunction>(function), i, &offset, &size) != 0) break;
    result.emplace_back(static_cast<int64_t>(offset), static_cast<int64_t>(size));
  }
  return result;
}

using LaunchSpec = std::tuple<int64_t, std::vector<int64_t>, int64_t, int64_t, py::bytes, std::vector<int64_t>,
                              std::vector<std::tuple<int64_t, int64_t, int64_t>>>;
using OutputSpec = std::tuple<int64_t, at::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t>;

int64_t add_plan(int64_t num_inputs, const std::vector<int64_t>& alloc_bytes, const std::vector<bool>& alloc_zero,
                 const std::vector<LaunchSpec>& launches, const std::vector<OutputSpec>& outputs) {
  check(alloc_bytes.size() == alloc_zero.size(), "allocation lists differ in length");
  auto plan = std::make_shared<Plan>();
  plan->num_inputs = num_inputs;
  plan->alloc_bytes = alloc_bytes;
  plan->alloc_zero = alloc_zero;
  const int64_t num_allocs = static_cast<int64_t>(alloc_bytes.size());
  auto check_source = [&](int64_t source) {
    check(source < num_inputs && source >= -num_allocs, "bad source ", source);
  };
  for (const auto& spec : launches) {
    Launch launch;
    launch.function = reinterpret_cast<CUfunction>(std::get<0>(spec));
    const auto& grid = std::get<1>(spec);
    check(grid.size() == 3, "a grid has 3 dimensions");
    for (int i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(grid[i]);
    launch.block = static_cast<unsigned>(std::get<2>(spec));
    launch.shared = static_cast<unsigned>(std::get<3>(spec));
    std::string bytes = std::get<4>(spec);
    launch.params.assign(bytes.begin(), bytes.end());
    launch.param_offsets = std::get<5>(spec);
    for (int64_t offset : launch.param_offsets) {
      check(offset >= 0 && offset < static_cast<int64_t>(launch.params.size()) + 1,
                  "parameter offset out of range");
    }
    for (const auto& p : std::get<6>(spec)) {
      Patch patch{std::get<0>(p), std::get<1>(p), std::get<2>(p)};
      check(patch.at >= 0 && patch.at + 8 <= static_cast<int64_t>(launch.params.size()),
                  "patch out of range");
      check_source(patch.source);
      launch.patches.push_back(patch);
    }
    plan->launches.push_back(std::move(launch));
  }
  for (const auto& spec : outputs) {
    Output out{std::get<0>(spec), std::get<1>(spec).scalar_type(), std::get<2>(spec), std::get<3>(spec),
               std::get<4>(spec)};
    check_source(out.source);
    check(out.sizes.size() == out.strides.size(), "output sizes/strides differ");
    plan->outputs.push_back(std::move(out));
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.push_back(std::move(plan));
  return static_cast<int64_t>(plans.size()) - 1;
}

// Each launch's parameter bytes with the addresses written in (no launch): what replay passes the
// driver. For tests on machines without a GPU.
std::vector<py::bytes> packed(int64_t id, const std::vector<int64_t>& input_addresses,
                              const std::vector<int64_t>& alloc_addresses) {
  auto plan = plan_at(id);
  std::vector<py::bytes> result;
  for (const Launch& launch : plan->launches) {
    std::vector<uint8_t> buffer = launch.params;
    for (const Patch& patch : launch.patches) {
      const uint64_t base = patch.source >= 0 ? input_addresses.at(patch.source) : alloc_addresses.at(-patch.source - 1);
      const uint64_t value = base + static_cast<uint64_t>(patch.offset);
      std::memcpy(buffer.data() + patch.at, &value, sizeof(value));
    }
    result.emplace_back(reinterpret_cast<const char*>(buffer.data()), buffer.size());
  }
  return result;
}

std::vector<at::Tensor> replay_unguarded(int64_t id, const std::vector<at::Tensor>& inputs, int64_t stream) {
  auto plan = plan_at(id);
  check(static_cast<int64_t>(inputs.size()) == plan->num_inputs, "plan ", id,
              " takes ", plan->num_inputs, " inputs, got ", inputs.size());
  check(!inputs.empty(), "a plan needs at least one input (for the device)");
  const auto options = at::TensorOptions().dtype(at::kByte).device(inputs[0].device());
  std::vector<at::Tensor> allocs;
  allocs.reserve(plan->alloc_bytes.size());
  for (size_t i = 0; i < plan->alloc_bytes.size(); ++i) {
    allocs.push_back(at::empty({plan->alloc_bytes[i]}, options));
    if (plan->alloc_zero[i]) allocs.back().zero_();
  }
  auto address = [&](int64_t source) -> uint64_t {
    const at::Tensor& t = source >= 0 ? inputs[source] : allocs[-source - 1];
    return reinterpret_cast<uint64_t>(t.data_ptr());
  };
  const Driver& d = driver();
  // 128-byte aligned parameter buffer (TMA descriptors are 64-byte aligned parameters).
  thread_local std::vector<uint8_t> storage;
  thread_local std::vector<void*> pointers;
  for (const Launch& launch : plan->launches) {
    storage.resize(launch.params.size() + 128);
    uint8_t* buffer = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 127) & ~uintptr_t(127));
    std::memcpy(buffer, launch.params.data(), launch.params.size());
    for (const Patch& patch : launch.patches) {
      const uint64_t value = address(patch.source) + static_cast<uint64_t>(patch.offset);
      std::memcpy(buffer + patch.at, &value, sizeof(value));
    }
    pointers.resize(launch.param_offsets.size());
    for (size_t i = 0; i < launch.param_offsets.size(); ++i) pointers[i] = buffer + launch.param_offsets[i];
    const CUresult status =
        d.launch(launch.function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block, 1, 1, launch.shared,
                 reinterpret_cast<CUstream>(stream), pointers.data(), nullptr);
    if (status != 0) {
      const char* text = nullptr;
      d.error_string(status, &text);
      check(false, "cuLaunchKernel failed: ", text ? text : "unknown error", " (",
                  status, ")");
    }
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(plan->outputs.size());
  for (const Output& out : plan->outputs) {
    const at::Tensor& base = out.source >= 0 ? inputs[out.source] : allocs[-out.source - 1];
    at::Tensor view = at::empty({0}, base.options().dtype(out.dtype));
    view.set_(base.storage(), out.storage_offset, out.sizes, out.strides);
    outputs.push_back(std::move(view));
  }
  return outputs;
}

// The entry points: (error message or "", result).
std::tuple<std::string, std::vector<std::tuple<int64_t, int64_t>>> param_info_entry(int64_t function) {
  return guarded<std::vector<std::tuple<int64_t, int64_t>>>([&] { return param_info(function); });
}

std::tuple<std::string, int64_t> add_plan_entry(int64_t num_inputs, const std::vector<int64_t>& alloc_bytes,
                                                const std::vector<bool>& alloc_zero,
                                                const std::vector<LaunchSpec>& launches,
                                                const std::vector<OutputSpec>& outputs) {
  return guarded<int64_t>([&] { return add_plan(num_inputs, alloc_bytes, alloc_zero, launches, outputs); });
}

std::tuple<std::string, std::vector<py::bytes>> packed_entry(int64_t id, const std::vector<int64_t>& input_addresses,
                                                             const std::vector<int64_t>& alloc_addresses) {
  return guarded<std::vector<py::bytes>>([&] { return packed(id, input_addresses, alloc_addresses); });
}

std::tuple<std::string, std::vector<at::Tensor>> replay(int64_t id, const std::vector<at::Tensor>& inputs,
                                                        int64_t stream) {
  return guarded<std::vector<at::Tensor>>([&] { return replay_unguarded(id, inputs, stream); });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "turbo_moe host launch plans (see turbo_moe/host_plan.py)";
  // Each returns (error message, result); the message is empty on success.
  m.def("param_info", &param_info_entry, "(offset, size) of each parameter of a CUfunction");
  m.def("add_plan", &add_plan_entry, "register a plan; returns its id");
  m.def("packed", &packed_entry, "each launch's parameter bytes with the given addresses written in");
  m.def("replay", &replay, "run a plan on new inputs: allocate, launch, return the outputs",
        py::arg("plan"), py::arg("inputs"), py::arg("stream"));
}
