// Host launch plans: replay a recorded sequence of kernel launches with new addresses, from C++.
//
// turbo_moe/host_plan.py records what one call of a hot region (an FP8 GEMM's forward or
// backward) launches on the GPU -- every kernel with the exact bytes of each parameter -- and
// registers that as a plan. A later call with the same signature (shapes, strides, dtypes,
// alignment, recipe) calls replay(): one C++ call makes the region's buffers as the recorded call
// made them (ATen's allocator, on the current stream), copies each launch's parameter template,
// writes the addresses into it (pointers, and the global-address field of each TMA descriptor)
// and calls cuLaunchKernel. The Python between the launches, which cost most of a layer's host
// time, is skipped; the kernels, their order, grids and parameters are the recorded ones.
//
// This file knows nothing of turbo_moe's kernels: a plan is bytes, offsets, address slots and
// allocation shapes. The CUDA driver is reached through dlopen (no CUDA headers or link at build
// time). The entry points return their own errors as text beside their results and the Python
// side raises; what ATen throws (an out-of-memory in replay) reaches Python as an exception.
// (Stop 28 kept this file torch-free and exception-free after an exception unwinding through an
// extension crashed a GPU machine's process; scripts/cpp_exception_probe.py no longer reproduces
// that there, docs/results/h100_host_plans.md.)
#include <torch/csrc/autograd/graph_task.h>
#include <torch/extension.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

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
  std::string error;                        // why the driver is unusable, if it is
};

const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      const char* why = dlerror();
      d.error = std::string("cannot open libcuda.so.1: ") + (why != nullptr ? why : "unknown error");
      return d;
    }
    d.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    d.error_string = reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    d.param_info = reinterpret_cast<FuncGetParamInfoFn>(dlsym(lib, "cuFuncGetParamInfo"));
    if (d.launch == nullptr || d.error_string == nullptr) d.error = "libcuda.so.1 lacks cuLaunchKernel/cuGetErrorString";
    return d;
  }();
  return loaded;
}

struct Patch {
  int64_t at;      // byte position in the launch's parameter buffer (8 bytes are written)
  int64_t slot;    // index into the addresses launch() receives
  int64_t offset;  // bytes added to that address
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

struct Plan {
  int64_t num_slots;
  std::vector<Launch> launches;
};

// One allocation of a replay: made as the recorded call made it, after dropping the earlier
// allocations whose last launch comes before this one's first (`release`).
struct Alloc {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  at::TensorOptions options;
  bool zero;
  std::vector<int64_t> release;         // earlier allocations to drop first
  std::vector<int64_t> release_inputs;  // inputs to drop first (freed if the caller handed over its reference)
};
using Allocs = std::vector<Alloc>;

std::mutex plans_mutex;
std::vector<std::shared_ptr<const Plan>> plans;
std::vector<std::shared_ptr<const Allocs>> plan_allocs;  // by plan id; null until set_allocs

const std::string kPrefix = "turbo_moe launch plans: ";

std::shared_ptr<const Plan> plan_at(int64_t id) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (id < 0 || id >= static_cast<int64_t>(plans.size())) return nullptr;
  return plans[id];
}

using ParamInfo = std::vector<std::tuple<int64_t, int64_t>>;

// (offset, size) of every parameter of a loaded kernel, from the driver.
std::tuple<std::string, ParamInfo> param_info(int64_t function) {
  ParamInfo result;
  const Driver& d = driver();
  if (!d.error.empty()) return {kPrefix + d.error, result};
  if (d.param_info == nullptr) return {kPrefix + "the driver has no cuFuncGetParamInfo (CUDA < 12.4)", result};
  for (size_t i = 0;; ++i) {
    size_t offset = 0, size = 0;
    if (d.param_info(reinterpret_cast<CUfunction>(function), i, &offset, &size) != 0) break;
    result.emplace_back(static_cast<int64_t>(offset), static_cast<int64_t>(size));
  }
  return {std::string(), result};
}

using LaunchSpec = std::tuple<int64_t, std::vector<int64_t>, int64_t, int64_t, py::bytes, std::vector<int64_t>,
                              std::vector<std::tuple<int64_t, int64_t, int64_t>>>;

std::tuple<std::string, int64_t> add_plan(int64_t num_slots, const std::vector<LaunchSpec>& launches) {
  auto plan = std::make_shared<Plan>();
  plan->num_slots = num_slots;
  for (size_t k = 0; k < launches.size(); ++k) {
    const auto& spec = launches[k];
    Launch launch;
    launch.function = reinterpret_cast<CUfunction>(std::get<0>(spec));
    const auto& grid = std::get<1>(spec);
    if (grid.size() != 3) return {kPrefix + "a grid has 3 dimensions", -1};
    for (int i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(grid[i]);
    launch.block = static_cast<unsigned>(std::get<2>(spec));
    launch.shared = static_cast<unsigned>(std::get<3>(spec));
    const std::string bytes = std::get<4>(spec);
    launch.params.assign(bytes.begin(), bytes.end());
    launch.param_offsets = std::get<5>(spec);
    const int64_t size = static_cast<int64_t>(launch.params.size());
    for (int64_t offset : launch.param_offsets) {
      if (offset < 0 || offset > size) return {kPrefix + "parameter offset out of range", -1};
    }
    for (const auto& p : std::get<6>(spec)) {
      Patch patch{std::get<0>(p), std::get<1>(p), std::get<2>(p)};
      if (patch.at < 0 || patch.at + 8 > size) return {kPrefix + "patch out of range", -1};
      if (patch.slot < 0 || patch.slot >= num_slots) return {kPrefix + "bad address slot " + std::to_string(patch.slot), -1};
      launch.patches.push_back(patch);
    }
    plan->launches.push_back(std::move(launch));
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.push_back(std::move(plan));
  plan_allocs.emplace_back();
  return {std::string(), static_cast<int64_t>(plans.size()) - 1};
}

using AllocSpec = std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::Tensor, bool, std::vector<int64_t>,
                             std::vector<int64_t>>;

// A plan's allocations, for replay(): (shape, strides, a tensor of their dtype and device, zero
// filled, the earlier allocations to drop first, the inputs to drop first). The plan's address
// slots are its inputs, then these.
std::string set_allocs(int64_t id, const std::vector<AllocSpec>& specs) {
  auto plan = plan_at(id);
  if (plan == nullptr) return kPrefix + "no plan " + std::to_string(id);
  const int64_t inputs = plan->num_slots - static_cast<int64_t>(specs.size());
  if (inputs < 1) return kPrefix + "more allocations than address slots";
  auto allocs = std::make_shared<Allocs>();
  for (size_t j = 0; j < specs.size(); ++j) {
    const auto& spec = specs[j];
    Alloc alloc{std::get<0>(spec), std::get<1>(spec), std::get<2>(spec).options(), std::get<3>(spec), std::get<4>(spec),
                std::get<5>(spec)};
    if (alloc.shape.size() != alloc.strides.size()) return kPrefix + "shape and strides differ in length";
    for (int64_t k : alloc.release) {
      if (k < 0 || k >= static_cast<int64_t>(j)) return kPrefix + "an allocation released before it is made";
    }
    for (int64_t k : alloc.release_inputs) {
      if (k < 0 || k >= inputs) return kPrefix + "an input release out of range";
    }
    allocs->push_back(std::move(alloc));
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  plan_allocs[id] = std::move(allocs);
  return std::string();
}

// Writes the addresses into a copy of one launch's template at `buffer`.
void patch_into(const Launch& launch, const std::vector<int64_t>& addresses, uint8_t* buffer) {
  std::memcpy(buffer, launch.params.data(), launch.params.size());
  for (const Patch& patch : launch.patches) {
    const uint64_t value = static_cast<uint64_t>(addresses[patch.slot]) + static_cast<uint64_t>(patch.offset);
    std::memcpy(buffer + patch.at, &value, sizeof(value));
  }
}

// Each launch's parameter bytes with the addresses written in (no launch): what launch() passes
// the driver. For tests on machines without a GPU.
std::tuple<std::string, std::vector<py::bytes>> packed(int64_t id, const std::vector<int64_t>& addresses) {
  std::vector<py::bytes> result;
  auto plan = plan_at(id);
  if (plan == nullptr) return {kPrefix + "no plan " + std::to_string(id), result};
  if (static_cast<int64_t>(addresses.size()) != plan->num_slots) return {kPrefix + "wrong number of addresses", result};
  for (const Launch& launch : plan->launches) {
    std::vector<uint8_t> buffer(launch.params.size());
    patch_into(launch, addresses, buffer.data());
    result.emplace_back(reinterpret_cast<const char*>(buffer.data()), buffer.size());
  }
  return {std::string(), result};
}

std::string launch(int64_t id, const std::vector<int64_t>& addresses, int64_t stream) {
  auto plan = plan_at(id);
  if (plan == nullptr) return kPrefix + "no plan " + std::to_string(id);
  if (static_cast<int64_t>(addresses.size()) != plan->num_slots) {
    return kPrefix + "plan " + std::to_string(id) + " takes " + std::to_string(plan->num_slots) + " addresses, got " +
           std::to_string(addresses.size());
  }
  const Driver& d = driver();
  if (!d.error.empty() && !plan->launches.empty()) return kPrefix + d.error;
  // 128-byte aligned parameter buffer (TMA descriptors are 64-byte aligned parameters).
  thread_local std::vector<uint8_t> storage;
  thread_local std::vector<void*> pointers;
  for (const Launch& one : plan->launches) {
    storage.resize(one.params.size() + 128);
    uint8_t* buffer = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 127) & ~uintptr_t(127));
    patch_into(one, addresses, buffer);
    pointers.resize(one.param_offsets.size());
    for (size_t i = 0; i < one.param_offsets.size(); ++i) pointers[i] = buffer + one.param_offsets[i];
    const CUresult status = d.launch(one.function, one.grid[0], one.grid[1], one.grid[2], one.block, 1, 1, one.shared,
                                     reinterpret_cast<CUstream>(stream), pointers.data(), nullptr);
    if (status != 0) {
      const char* text = nullptr;
      d.error_string(status, &text);
      return kPrefix + "cuLaunchKernel failed: " + (text != nullptr ? text : "unknown error") + " (" +
             std::to_string(status) + ")";
    }
  }
  return std::string();
}

// A replay in one call: the plan's allocations (as set_allocs registered them), then its
// launches with the inputs' and allocations' addresses. Returns (error, the allocations; a
// released one is undefined, None in Python). An input is dropped from `inputs` before the first
// allocation made after its last launch: where the caller handed over the only reference (a
// layer's gradient, an intermediate of its table), its block may be reused by that allocation,
// which is safe because the launches run in the recorded order on one stream.
std::tuple<std::string, std::vector<at::Tensor>> replay_dropping(int64_t id, std::vector<at::Tensor>& inputs,
                                                                 int64_t stream) {
  std::vector<at::Tensor> made;
  std::shared_ptr<const Allocs> allocs;
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    if (id >= 0 && id < static_cast<int64_t>(plan_allocs.size())) allocs = plan_allocs[id];
  }
  if (allocs == nullptr) return {kPrefix + "plan " + std::to_string(id) + " has no allocations set", made};
  std::vector<int64_t> addresses;
  addresses.reserve(inputs.size() + allocs->size());
  for (const at::Tensor& t : inputs) addresses.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  made.reserve(allocs->size());
  for (const Alloc& alloc : *allocs) {
    for (int64_t j : alloc.release_inputs) inputs[j] = at::Tensor();
    for (int64_t j : alloc.release) made[j] = at::Tensor();  // dead before this one is first used
    made.push_back(alloc.zero ? at::zeros(alloc.shape, alloc.options)
                              : at::empty_strided(alloc.shape, alloc.strides, alloc.options));
    addresses.push_back(reinterpret_cast<int64_t>(made.back().data_ptr()));
  }
  return {launch(id, addresses, stream), made};
}

// replay_dropping on the caller's inputs, which keeps its references (Python's replay()).
std::tuple<std::string, std::vector<at::Tensor>> replay(int64_t id, std::vector<at::Tensor> inputs, int64_t stream) {
  return replay_dropping(id, inputs, stream);
}


// ----------------------------------------------------------------------- a plan's outputs

// Where each output of a plan's region comes from: nothing (kind 0), one of its tensor inputs
// (1: `index` into replay()'s inputs), an allocation (2) or a view of one (3: sizes, strides,
// storage offset in elements).
struct OutputSpec {
  int64_t kind;
  int64_t index;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset;
};
using OutputSpecs = std::vector<OutputSpec>;
std::vector<std::shared_ptr<const OutputSpecs>> plan_outputs;  // by plan id; null until set_outputs

using OutputSpecTuple = std::tuple<int64_t, int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t>;

std::string set_outputs(int64_t id, const std::vector<OutputSpecTuple>& specs) {
  auto plan = plan_at(id);
  if (plan == nullptr) return kPrefix + "no plan " + std::to_string(id);
  auto outputs = std::make_shared<OutputSpecs>();
  for (const auto& t : specs) {
    OutputSpec spec{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)};
    if (spec.kind < 0 || spec.kind > 3) return kPrefix + "an output of unknown kind";
    if (spec.kind != 0 && (spec.index < 0 || spec.index >= plan->num_slots)) return kPrefix + "an output out of range";
    if (spec.kind == 3 && spec.sizes.size() != spec.strides.size()) return kPrefix + "a view's sizes and strides differ in length";
    outputs->push_back(std::move(spec));
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (plan_outputs.size() < plans.size()) plan_outputs.resize(plans.size());
  plan_outputs[id] = std::move(outputs);
  return std::string();
}

// replay() and the region's outputs as set_outputs registered them; throws (as torch's
// RuntimeError) on any error.
std::vector<at::Tensor> run_plan(int64_t id, std::vector<at::Tensor> inputs, int64_t stream) {
  std::shared_ptr<const OutputSpecs> specs;
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    if (id >= 0 && id < static_cast<int64_t>(plan_outputs.size())) specs = plan_outputs[id];
  }
  TORCH_CHECK(specs != nullptr, kPrefix, "plan ", id, " has no outputs set");
  auto [error, allocs] = replay_dropping(id, inputs, stream);  // never drops an input that is an output
  TORCH_CHECK(error.empty(), error);
  std::vector<at::Tensor> outputs;
  outputs.reserve(specs->size());
  for (const OutputSpec& spec : *specs) {
    if (spec.kind == 0) {
      outputs.emplace_back();
    } else if (spec.kind == 1) {
      outputs.push_back(inputs.at(spec.index));
    } else if (spec.kind == 2) {
      outputs.push_back(allocs.at(spec.index));
    } else {
      outputs.push_back(allocs.at(spec.index).as_strided(spec.sizes, spec.strides, spec.offset));
    }
  }
  return outputs;
}

// ------------------------------------------------------------- a layer as one autograd node
//
// A *layer* is a differentiable function y = f(args) whose forward and backward are recorded
// plans, wired by a table of values: the arguments first (tensors, or absent), then each step's
// outputs where the layer says (turbo_moe/planned_layer.py lays out a grouped linear's table,
// turbo_moe/planned_mlp.py an expert MLP's). PlannedLayer's forward runs the forward steps and
// saves what the backward steps read; its backward (a C++ node, so the autograd engine runs it
// without Python) replays the backward steps on the incoming gradient and hands back, for each
// argument, the value the layer names as its gradient. Anything a plan does not cover -- a second
// backward after a held value was released, a gradient whose layout differs from the recorded
// one, double backward -- goes to the Python fallback registered by set_layer_fallback, which
// runs the Python path's backward.

struct Step {
  int64_t plan;
  std::vector<int64_t> inputs;   // value index of each tensor input of the plan, in order
  std::vector<int64_t> outputs;  // value index receiving each plan output (-1: not kept)
  std::vector<int64_t> release;  // values dropped after the step (dead: freed before the next step allocates)
};

struct Layer {
  int64_t num_values;
  int64_t num_args;
  std::vector<Step> forward;
  std::vector<Step> backward;
  std::vector<int64_t> saved;  // values saved for backward (with autograd's version checks)
  std::vector<int64_t> held;   // values held for the first backward only, released by it
  std::vector<int64_t> kept;   // values the steps made that backward reads: kept by the node until its
                               // backward (or the graph's release), then freed as the steps' release lists say
  int64_t y, dy;               // value indices
  std::vector<int64_t> grads;  // per argument, the value holding its gradient (-1: none)
};

std::vector<std::shared_ptr<const Layer>> layers;
py::object* layer_fallback = nullptr;  // leaked on purpose: never destroyed after the interpreter
std::vector<int64_t> replayed_in_backward;  // plan ids, for the Python side's dispatch records

using StepTuple = std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;

std::tuple<std::string, int64_t> add_layer(int64_t num_values, int64_t num_args, const std::vector<StepTuple>& forward,
                                           const std::vector<StepTuple>& backward, const std::vector<int64_t>& saved,
                                           const std::vector<int64_t>& held, const std::vector<int64_t>& kept,
                                           int64_t y, int64_t dy, const std::vector<int64_t>& grads) {
  auto layer = std::make_shared<Layer>();
  if (num_args < 1 || num_args > num_values) return {kPrefix + "a layer's value table starts with its arguments", -1};
  if (static_cast<int64_t>(grads.size()) != num_args) return {kPrefix + "a layer names one gradient per argument", -1};
  layer->num_values = num_values;
  layer->num_args = num_args;
  auto in_range = [&](int64_t v) { return v >= 0 && v < num_values; };
  auto make_step = [&](const StepTuple& t, Step& step) -> std::string {
    step.plan = std::get<0>(t);
    step.inputs = std::get<1>(t);
    step.outputs = std::get<2>(t);
    step.release = std::get<3>(t);
    if (plan_at(step.plan) == nullptr) return kPrefix + "no plan " + std::to_string(step.plan);
    for (int64_t v : step.inputs) if (!in_range(v)) return kPrefix + "a step input out of range";
    for (int64_t v : step.outputs) if (v != -1 && !in_range(v)) return kPrefix + "a step output out of range";
    for (int64_t v : step.release) if (!in_range(v)) return kPrefix + "a released value out of range";
    return std::string();
  };
  std::string error;
  for (const auto& t : forward) {
    if (!error.empty()) break;
    layer->forward.emplace_back();
    error = make_step(t, layer->forward.back());
  }
  for (const auto& t : backward) {
    if (!error.empty()) break;
    layer->backward.emplace_back();
    error = make_step(t, layer->backward.back());
  }
  if (error.empty() && layer->forward.empty()) error = kPrefix + "a layer without forward steps";
  if (!error.empty()) return {error, -1};
  layer->saved = saved;
  layer->held = held;
  layer->kept = kept;
  layer->grads = grads;
  layer->y = y;
  layer->dy = dy;
  bool ok = in_range(y) && in_range(dy);
  for (int64_t v : saved) ok = ok && in_range(v);
  for (int64_t v : held) ok = ok && in_range(v);
  for (int64_t v : kept) ok = ok && in_range(v);
  for (int64_t v : grads) ok = ok && (v == -1 || in_range(v));
  if (!ok) return {kPrefix + "a layer value index out of range", -1};
  std::lock_guard<std::mutex> lock(plans_mutex);
  layers.push_back(std::move(layer));
  return {std::string(), static_cast<int64_t>(layers.size()) - 1};
}

std::shared_ptr<const Layer> layer_at(int64_t id) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (id < 0 || id >= static_cast<int64_t>(layers.size())) return nullptr;
  return layers[id];
}

void run_step(const Step& step, std::vector<at::Tensor>& values, int64_t stream) {
  std::vector<at::Tensor> inputs;
  inputs.reserve(step.inputs.size());
  for (int64_t v : step.inputs) {
    TORCH_CHECK(values[v].defined(), kPrefix, "a step input (value ", v, ") is missing");
    inputs.push_back(values[v]);
  }
  // The inputs this step releases leave the table before its plan runs: where the table held the
  // only reference (the gradient the engine handed over, an intermediate), the replay frees each
  // after its last launch, so the allocations made after that may take its block.
  for (int64_t v : step.release) {
    if (std::find(step.inputs.begin(), step.inputs.end(), v) != step.inputs.end()) values[v] = at::Tensor();
  }
  std::vector<at::Tensor> outputs = run_plan(step.plan, std::move(inputs), stream);
  TORCH_CHECK(outputs.size() == step.outputs.size(), kPrefix, "plan ", step.plan, " made ", outputs.size(),
              " outputs, the step expects ", step.outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (step.outputs[k] != -1) values[step.outputs[k]] = std::move(outputs[k]);
  }
  for (int64_t v : step.release) values[v] = at::Tensor();
}

}  // namespace

namespace turbo_moe {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Named outside the anonymous namespace: autograd shows it as CppNode<turbo_moe::PlannedLayer>.
// Its tensors come as one TensorList of the arguments present, at ``positions`` of the table
// (autograd gives each an input edge and expects one gradient per tensor back; an undefined
// tensor cannot be an autograd input).
struct PlannedLayer : public torch::autograd::Function<PlannedLayer> {
  static at::Tensor forward(AutogradContext* ctx, int64_t layer_id, int64_t stream, std::vector<int64_t> positions,
                            at::TensorList args) {
    auto layer = layer_at(layer_id);
    TORCH_CHECK(layer != nullptr, kPrefix, "no layer ", layer_id);
    std::vector<at::Tensor> values(layer->num_values);
    for (size_t k = 0; k < args.size(); ++k) values[positions[k]] = args[k];
    for (const Step& step : layer->forward) run_step(step, values, stream);
    std::vector<at::Tensor> saved;
    saved.reserve(layer->saved.size());
    for (int64_t v : layer->saved) saved.push_back(values[v]);
    ctx->save_for_backward(saved);
    for (size_t k = 0; k < layer->held.size(); ++k) ctx->saved_data["held" + std::to_string(k)] = values[layer->held[k]];
    for (size_t k = 0; k < layer->kept.size(); ++k) ctx->saved_data["kept" + std::to_string(k)] = values[layer->kept[k]];
    ctx->saved_data["layer"] = layer_id;
    ctx->saved_data["stream"] = stream;
    ctx->saved_data["positions"] = positions;
    return values[layer->y];
  }

  // `grads` by reference (a template, whichever way torch passes its list): the engine's list is
  // the only other owner of dy, so clearing it lets the steps free dy once they quantized it.
  template <typename Grads>
  static variable_list backward(AutogradContext* ctx, Grads&& grads) {
    const int64_t layer_id = ctx->saved_data["layer"].toInt();
    const int64_t stream = ctx->saved_data["stream"].toInt();
    const std::vector<int64_t> positions = ctx->saved_data["positions"].toIntVector();
    auto layer = layer_at(layer_id);
    TORCH_CHECK(layer != nullptr, kPrefix, "no layer ", layer_id);
    std::vector<at::Tensor> values(layer->num_values);
    const variable_list saved = ctx->get_saved_variables();
    for (size_t k = 0; k < saved.size(); ++k) values[layer->saved[k]] = saved[k];
    // The first backward releases what is held (Python path: e.g. ctx.w_kn set to None).
    std::vector<at::Tensor> held(layer->held.size());
    bool all_held = true;
    for (size_t k = 0; k < held.size(); ++k) {
      const std::string name = "held" + std::to_string(k);
      auto it = ctx->saved_data.find(name);
      if (it != ctx->saved_data.end() && it->second.isTensor()) held[k] = it->second.toTensor();
      ctx->saved_data[name] = at::IValue();
      all_held = all_held && held[k].defined();
    }
    at::Tensor dy = grads[0].contiguous();
    grads[0] = at::Tensor();
    // The plans were recorded on a 16-byte aligned dy; under create_graph the result must stay
    // once-differentiable (an error if differentiated again): both go to the Python path.
    // Kept values leave the node with this backward unless the graph is retained for another.
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    for (size_t k = 0; k < layer->kept.size(); ++k) {
      const std::string name = "kept" + std::to_string(k);
      auto it = ctx->saved_data.find(name);
      TORCH_CHECK(it != ctx->saved_data.end() && it->second.isTensor(), kPrefix,
                  "Trying to backward through a planned layer a second time (its intermediate values were freed "
                  "by the first backward); specify retain_graph=True the first time");
      values[layer->kept[k]] = it->second.toTensor();
      if (!keep_graph) ctx->saved_data[name] = at::IValue();
    }
    const bool planned = all_held && !torch::autograd::GradMode::is_enabled() &&
                         reinterpret_cast<uintptr_t>(dy.data_ptr()) % 16 == 0;
    // One gradient per forward argument: layer id, stream, positions, then each tensor of args.
    std::vector<at::Tensor> grad_of(layer->num_args);
    if (planned) {
      for (size_t k = 0; k < held.size(); ++k) values[layer->held[k]] = std::move(held[k]);
      values[layer->dy] = std::move(dy);
      for (const Step& step : layer->backward) run_step(step, values, stream);
      {
        std::lock_guard<std::mutex> lock(plans_mutex);
        // Bounded if nobody reads them: the oldest half goes (the Python side keeps the last 256 records).
        if (replayed_in_backward.size() > 4096) replayed_in_backward.erase(replayed_in_backward.begin(), replayed_in_backward.begin() + 2048);
        for (const Step& step : layer->backward) replayed_in_backward.push_back(step.plan);
      }
      for (int64_t k = 0; k < layer->num_args; ++k)
        if (layer->grads[k] != -1) grad_of[k] = values[layer->grads[k]];
    } else {
      TORCH_CHECK(layer_fallback != nullptr, kPrefix, "no backward fallback registered");
      for (size_t k = 0; k < held.size(); ++k) values[layer->held[k]] = std::move(held[k]);
      py::gil_scoped_acquire gil;
      py::list table;  // the value table as backward found it (None: absent, or a held value released)
      for (const at::Tensor& t : values) table.append(t.defined() ? py::cast(t) : py::none());
      values.clear();
      py::sequence out = (*layer_fallback)(layer_id, dy, table, torch::autograd::GradMode::is_enabled());
      TORCH_CHECK(static_cast<int64_t>(py::len(out)) == layer->num_args, kPrefix,
                  "the Python backward returned ", py::len(out), " gradients for ", layer->num_args, " arguments");
      for (int64_t k = 0; k < layer->num_args; ++k)
        if (!out[k].is_none()) grad_of[k] = out[k].cast<at::Tensor>();
    }
    variable_list result(3 + positions.size());
    for (size_t k = 0; k < positions.size(); ++k) result[3 + k] = std::move(grad_of[positions[k]]);
    return result;
  }
};

at::Tensor apply_layer(int64_t layer_id, int64_t stream, const std::vector<std::optional<at::Tensor>>& args) {
  auto layer = layer_at(layer_id);
  TORCH_CHECK(layer != nullptr, kPrefix, "no layer ", layer_id);
  TORCH_CHECK(static_cast<int64_t>(args.size()) == layer->num_args, kPrefix, "layer ", layer_id, " takes ",
              layer->num_args, " arguments, got ", args.size());
  std::vector<int64_t> positions;
  std::vector<at::Tensor> tensors;
  for (size_t k = 0; k < args.size(); ++k) {
    if (args[k].has_value() && args[k]->defined()) {
      positions.push_back(static_cast<int64_t>(k));
      tensors.push_back(*args[k]);
    }
  }
  // As a Python Function's apply does: a profiler range named after the node and carrying the
  // sequence number its node takes, which ties the node's backward (the engine's
  // evaluate_function range) to this forward in a trace.
  RECORD_FUNCTION("turbo_moe::PlannedLayer", std::vector<c10::IValue>(), at::sequence_number::peek());
  return PlannedLayer::apply(layer_id, stream, std::move(positions), at::TensorList(tensors));
}

}  // namespace turbo_moe

namespace {

void set_layer_fallback(py::object fallback) {
  if (layer_fallback == nullptr) layer_fallback = new py::object();
  *layer_fallback = std::move(fallback);
}

std::vector<int64_t> take_replayed() {
  std::lock_guard<std::mutex> lock(plans_mutex);
  std::vector<int64_t> taken;
  taken.swap(replayed_in_backward);
  return taken;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "turbo_moe host launch plans (see turbo_moe/host_plan.py); errors are returned as text";
  m.def("param_info", &param_info, "(error, [(offset, size)] of each parameter of a CUfunction)");
  m.def("add_plan", &add_plan, "(error, id): register a plan (number of address slots, launches)");
  m.def("packed", &packed, "(error, each launch's parameter bytes with the given addresses written in)");
  m.def("launch", &launch, "run a plan's launches with these addresses on this stream; returns the error or ''",
        py::arg("plan"), py::arg("addresses"), py::arg("stream"));
  m.def("set_allocs", &set_allocs, "register a plan's allocations for replay(); returns the error or ''");
  m.def("replay", &replay, "(error, allocations): make a plan's allocations and run its launches",
        py::arg("plan"), py::arg("inputs"), py::arg("stream"));
  m.def("set_outputs", &set_outputs, "register where a plan's outputs come from (run_plan, layers); returns the error or ''");
  m.def("run_plan", &run_plan, "a replay's outputs (raises on error)", py::arg("plan"), py::arg("inputs"),
        py::arg("stream"));
  m.def("add_layer", &add_layer,
        "(error, id): register a layer: its forward and backward steps over a value table that starts with its arguments");
  m.def("apply_layer", &turbo_moe::apply_layer,
        "run a layer's forward on its arguments (None where absent); the result's grad_fn runs its backward steps in C++",
        py::arg("layer"), py::arg("stream"), py::arg("args"));
  m.def("set_layer_fallback", &set_layer_fallback, "the Python backward for what a layer's plans do not cover");
  m.def("take_replayed", &take_replayed, "the plans replayed by layer backwards since the last call (and forget them)");
}
