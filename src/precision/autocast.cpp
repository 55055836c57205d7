#include "frugal/precision/autocast.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <dlfcn.h>
#include <sched.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>

#include "frugal/io/numbers.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace frugal {
namespace precision {
namespace {

// LibTorch 2.x takes the device as an argument; 1.13 has one function per device.
bool enabled_on(c10::DeviceType d) {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::is_autocast_enabled(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}
at::ScalarType dtype_of(c10::DeviceType d) {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::get_autocast_dtype(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}
void set_on(c10::DeviceType d, bool on, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_enabled(d, on);
  at::autocast::set_autocast_dtype(d, dtype);
#else
  if (d == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(on);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_enabled(on);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}
void set_state(const AutocastState& s) {
  set_on(c10::DeviceType::CPU, s.cpu, s.cpu_dtype);
  set_on(c10::DeviceType::CUDA, s.cuda, s.cuda_dtype);
  at::autocast::set_autocast_cache_enabled(s.cache);
}

const char* short_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kFloat: return "fp32";
    default: return c10::toString(t);
  }
}

}  // namespace

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu = enabled_on(c10::DeviceType::CPU);
  s.cpu_dtype = dtype_of(c10::DeviceType::CPU);
  s.cuda = enabled_on(c10::DeviceType::CUDA);
  s.cuda_dtype = dtype_of(c10::DeviceType::CUDA);
  s.cache = at::autocast::is_autocast_cache_enabled();
  return s;
}

AutocastState AutocastState::off() { return AutocastState(); }

AutocastState AutocastState::compute(c10::DeviceType device, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "autocast: the compute dtype must be fp32, bf16 or fp16, got ", dtype);
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA, "autocast: only CPU and CUDA devices, got ", device);
  AutocastState s;
  s.cache = false;
  if (dtype == at::kFloat) return s;
  if (device == c10::DeviceType::CPU) {
    s.cpu = true;
    s.cpu_dtype = dtype;
  } else {
    s.cuda = true;
    s.cuda_dtype = dtype;
  }
  return s;
}

bool AutocastState::operator==(const AutocastState& o) const {
  return cpu == o.cpu && cuda == o.cuda && (!cpu || cpu_dtype == o.cpu_dtype) && (!cuda || cuda_dtype == o.cuda_dtype) && cache == o.cache;
}

std::string AutocastState::describe() const {
  if (!enabled()) return "off";
  std::string out;
  if (cpu) out += std::string("cpu ") + short_name(cpu_dtype);
  if (cuda) out += std::string(out.empty() ? "" : ", ") + "cuda " + short_name(cuda_dtype);
  return out;
}

AutocastGuard::AutocastGuard(const AutocastState& state) : previous_(AutocastState::current()) {
  set_state(state);
  if (state.enabled()) {
    at::autocast::increment_nesting();
    nested_ = true;
  }
}

AutocastGuard::~AutocastGuard() {
  if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_state(previous_);
}

at::ScalarType compute_dtype_for(const at::Tensor& x) {
  if (x.scalar_type() != at::kFloat) return x.scalar_type();
  const c10::DeviceType d = x.device().type();
  if ((d == c10::DeviceType::CPU || d == c10::DeviceType::CUDA) && enabled_on(d)) return dtype_of(d);
  return x.scalar_type();
}

bool fast_bf16(c10::DeviceType device, std::string* why) {
  auto say = [&](const char* text) {
    if (why != nullptr) *why = text;
  };
  if (device == c10::DeviceType::CUDA) {
    // Autocast bf16 runs on any CUDA device LibTorch supports; tensor-core bf16 needs sm_80+,
    // which every device a current CUDA wheel targets by default has.
    const bool has = at::hasCUDA();
    say(has ? "a CUDA device" : "no CUDA device");
    return has;
  }
  if (device != c10::DeviceType::CPU) {
    say("not a CPU or CUDA device");
    return false;
  }
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  // The OS must save the AVX-512 registers (XCR0 bits 5-7) for either instruction set to be usable.
  bool os_avx512 = false;
  if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27)) != 0) {  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    os_avx512 = (lo & 0xE6u) == 0xE6u;
  }
  bool avx512_bf16 = false, amx_bf16 = false;
  if (os_avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) avx512_bf16 = (a & (1u << 5)) != 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) amx_bf16 = (d & (1u << 22)) != 0;
  if (amx_bf16) {
    say("this CPU has AMX-BF16");
    return true;
  }
  if (avx512_bf16) {
    say("this CPU has AVX512-BF16");
    return true;
  }
  say("this CPU has neither AVX512-BF16 nor AMX-BF16");
  return false;
#else
  say("bf16 matrix instructions are only detected on x86-64 CPUs");
  return false;
#endif
}

namespace {

// The cores this process may run on; FRUGAL_NUM_THREADS (a launcher's share of them) caps it.
int usable_cores() {
  int n = 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) n = std::max(1, CPU_COUNT(&set));
  if (const char* share = std::getenv("FRUGAL_NUM_THREADS"); share && *share) {
    // The launcher's bound (dist/launch.h kMaxThreads); a bad value is refused, not ignored.
    const int64_t s = io::parse_int(share, "the environment variable FRUGAL_NUM_THREADS", 1, 4096);
    if (s < n) n = static_cast<int>(s);
  }
  return n;
}

// OpenBLAS's thread-count calls, when the loaded BLAS is OpenBLAS (found by name at run time:
// frugal links only the reference BLAS interface).
using SetThreads = void (*)(int);
using GetThreads = int (*)();
SetThreads blas_set_threads() { return reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")); }
GetThreads blas_get_threads() { return reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads")); }

}  // namespace

ComputeThreadsGuard::ComputeThreadsGuard(c10::DeviceType device, at::ScalarType compute) {
  if (device != c10::kCPU || compute == at::kFloat || compute == at::kDouble) return;
  const int cores = usable_cores(), now = at::get_num_threads();
  if (cores > now) {
    previous_threads_ = now;
    at::set_num_threads(cores);
    what_ = std::to_string(cores) + " intra-op threads (LibTorch's default here: " + std::to_string(now) + ")";
  }
  const SetThreads set = blas_set_threads();
  const GetThreads get = blas_get_threads();
  if (set && get && get() > 1) {
    previous_blas_threads_ = get();
    set(1);
    what_ += std::string(what_.empty() ? "" : ", ") + "OpenBLAS at 1 thread (was " + std::to_string(previous_blas_threads_) + ")";
  }
}

ComputeThreadsGuard::~ComputeThreadsGuard() {
  if (previous_threads_ > 0) at::set_num_threads(previous_threads_);
  if (previous_blas_threads_ > 0) {
    if (const SetThreads set = blas_set_threads()) set(previous_blas_threads_);
  }
}

}  // namespace precision
}  // namespace frugal
