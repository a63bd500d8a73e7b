// Python bindings (pybind11 only, no torch headers: the extension builds in seconds).
// Tensors cross as raw addresses; ostinato/layers/moe/cpu_experts.py checks dtypes,
// shapes and contiguity and keeps the tensors alive until wait().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>

#include "experts.h"

namespace py = pybind11;
using namespace ostinato;

namespace {

template <class T>
void def_ptr(py::class_<ColdArgs>& c, const char* name, T ColdArgs::*field) {
  c.def_property(
      name, [field](const ColdArgs& a) { return reinterpret_cast<uintptr_t>(a.*field); },
      [field](ColdArgs& a, uintptr_t v) { a.*field = reinterpret_cast<T>(v); });
}

const char* isa_str(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAmx: return "amx";
    default: return "auto";
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Ostinato cold-expert CPU kernels and resident thread pool";

  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx512"] = f.avx512;
    d["avx512_bf16"] = f.avx512_bf16;
    d["amx"] = f.amx;
    return d;
  });

  py::class_<ColdArgs> args(m, "ColdArgs");
  args.def(py::init<>());
  def_ptr(args, "w13", &ColdArgs::w13);
  def_ptr(args, "w2", &ColdArgs::w2);
  def_ptr(args, "x", &ColdArgs::x);
  def_ptr(args, "token_idx", &ColdArgs::token_idx);
  def_ptr(args, "expert_ids", &ColdArgs::expert_ids);
  def_ptr(args, "weights", &ColdArgs::weights);
  def_ptr(args, "out", &ColdArgs::out);
  args.def_property(
      "w_dtype", [](const ColdArgs& a) { return int(a.w_dtype); },
      [](ColdArgs& a, int v) { a.w_dtype = DType(v); });
  args.def_property(
      "x_dtype", [](const ColdArgs& a) { return int(a.x_dtype); },
      [](ColdArgs& a, int v) { a.x_dtype = DType(v); });
  args.def_property(
      "isa", [](const ColdArgs& a) { return int(a.isa); }, [](ColdArgs& a, int v) { a.isa = Isa(v); });
  args.def_readwrite("E", &ColdArgs::E)
      .def_readwrite("D", &ColdArgs::D)
      .def_readwrite("F", &ColdArgs::F)
      .def_readwrite("T", &ColdArgs::T)
      .def_readwrite("x_stride", &ColdArgs::x_stride)
      .def_readwrite("R", &ColdArgs::R)
      .def_readwrite("out_stride", &ColdArgs::out_stride)
      .def_readwrite("amx_min_tokens", &ColdArgs::amx_min_tokens)
      .def_readwrite("down_mode", &ColdArgs::down_mode)
      .def_readwrite("prefetch", &ColdArgs::prefetch);

  py::class_<ColdExperts>(m, "ColdExperts")
      .def(py::init<const std::vector<int>&, int64_t>(), py::arg("cpus"), py::arg("spin_us"))
      .def("submit", &ColdExperts::submit, py::call_guard<py::gil_scoped_release>())
      .def("wait", &ColdExperts::wait, py::call_guard<py::gil_scoped_release>())
      .def("forward",
           [](ColdExperts& self, const ColdArgs& a) { cold_experts_forward(a, self); },
           py::call_guard<py::gil_scoped_release>())
      .def(
          "timed_forward",
          [](ColdExperts& self, const ColdArgs& a) {  // seconds of submit + wait, from C++
            auto t0 = std::chrono::steady_clock::now();
            cold_experts_forward(a, self);
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          },
          py::call_guard<py::gil_scoped_release>())
      .def("ready", &ColdExperts::ready)
      .def("reserve", &ColdExperts::reserve, py::arg("routes"), py::arg("tokens"), py::arg("E"),
           py::arg("D"), py::arg("F"))
      .def("num_threads", &ColdExperts::num_threads)
      .def("set_spin_us", &ColdExperts::set_spin_us)
      .def("last_stats", [](const ColdExperts& self) {
        ColdStats s = self.last_stats();
        py::dict d;
        d["isa"] = isa_str(s.isa);
        d["experts"] = s.experts;
        d["amx_experts"] = s.amx_experts;
        d["routes"] = s.routes;
        d["scatter"] = s.scatter;
        d["phase_end_us"] = py::make_tuple(s.phase_end_us[0], s.phase_end_us[1], s.phase_end_us[2],
                                           s.phase_end_us[3]);
        return d;
      });
}
