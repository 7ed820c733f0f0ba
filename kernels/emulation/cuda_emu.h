// CPU emulation of the CUDA features our kernels use, so the same .cu compiles with g++.
//
// What and why: tests run every kernel on the CPU against a torch reference, also under
// ThreadSanitizer and AddressSanitizer, on machines without a GPU. The harness is deliberately
// strict where real hardware is forgiving by accident:
//   * one std::thread per CUDA thread of a block; blocks run one after another on the same pool;
//   * __syncthreads is a real barrier that also checks every thread reached the same call site
//     (a thread that left the kernel while others wait is reported too);
//   * warp shuffles exchange values through a per-warp slot array between two warp barriers and
//     reject masks other than "every thread of the warp";
//   * a launch where every thread waits on a barrier that can never complete is reported as a
//     deadlock instead of hanging the test;
//   * __shared__ storage is refilled with the byte 0x7f before each block, so a read of shared
//     memory nobody wrote in this block returns 3.39e38 instead of a plausible zero. (Under
//     AddressSanitizer __shared__ is plain static storage instead, so ASan's redzones see overruns.)
//   * __half and __nv_bfloat16 are 16-bit storage types with round-to-nearest-even conversions.
// Force-included (g++ -include cuda_emu.h); kernels/emulation/include/cuda_fp16.h and cuda_bf16.h
// are empty shims so the kernels' #include lines resolve here.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- qualifiers -------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#if defined(__SANITIZE_ADDRESS__)
#define __shared__ static
#else
#define __shared__ static __attribute__((section("emu_shared")))
#endif

// ---- built-in index variables -------------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;

// ---- 16-bit floating-point storage types ----------------------------------------------------------
struct __half {
  unsigned short __x;
};
struct __nv_bfloat16 {
  unsigned short __x;
};

namespace emu {
inline unsigned f2u(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
}  // namespace emu

inline float __half2float(__half h) {
  const unsigned sign = (unsigned)(h.__x & 0x8000u) << 16;
  const unsigned exp = (h.__x >> 10) & 0x1fu;
  const unsigned man = h.__x & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float v = std::ldexp((float)man, -24);
    return sign ? -v : v;
  }
  if (exp == 31) return emu::u2f(sign | 0x7f800000u | (man << 13));  // inf / nan
  return emu::u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even (F. Giesen's float_to_half_fast3_rtne); NaN becomes a quiet NaN.
inline __half __float2half_rn(float f) {
  unsigned u = emu::f2u(f);
  const unsigned sign = u & 0x80000000u;
  u ^= sign;
  unsigned short out;
  if (u >= (143u << 23)) {  // >= 65536: inf, or nan
    out = u > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (u < (113u << 23)) {  // below the smallest normal half: subnormal or zero
    const unsigned magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float sum = emu::u2f(u) + emu::u2f(magic);  // the FPU rounds to nearest even here
    out = (unsigned short)(emu::f2u(sum) - magic);
  } else {
    const unsigned mant_odd = (u >> 13) & 1u;
    u += ((unsigned)(15 - 127) << 23) + 0xfffu;
    u += mant_odd;
    out = (unsigned short)(u >> 13);
  }
  return __half{(unsigned short)(out | (sign >> 16))};
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 b) { return emu::u2f((unsigned)b.__x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = emu::f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(unsigned short)((u >> 16) | 0x40u)};
  return __nv_bfloat16{(unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// ---- math intrinsics ------------------------------------------------------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
using std::fmaxf;
using std::fminf;

// ---- the launch: a thread pool running the blocks one after another -----------------------------
namespace emu {

struct Abort {};  // unwinds every emulated thread once the launch has failed

constexpr int kExitSite = -1;  // the "call site" of a thread that returned from the kernel

// Arrivals are counted under the launch mutex; waiting is a futex on the generation word, so a
// completed barrier wakes its waiters without making them fight for the mutex again. The
// generation is atomic (release by the completing thread, acquire by the waiters): that is the
// happens-before edge ThreadSanitizer sees.
struct Barrier {
  int expected = 0;
  int arrived = 0;
  int site = 0;
  std::atomic<unsigned> generation{0};
};

inline void futex_wait(std::atomic<unsigned>& word, unsigned old) {
  syscall(SYS_futex, reinterpret_cast<unsigned*>(&word), FUTEX_WAIT_PRIVATE, old, nullptr, nullptr, 0);
}
inline void futex_wake_all(std::atomic<unsigned>& word) {
  syscall(SYS_futex, reinterpret_cast<unsigned*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

struct Launch {
  dim3 grid, block;
  int num_threads = 0;
  std::mutex mutex;
  Barrier block_barrier;           // __syncthreads and the end of each block
  std::vector<Barrier> warp_barriers;  // one per warp: the shuffles
  std::vector<unsigned long long> warp_slots;  // [num_warps][2][32] shuffle mailboxes
  int blocked = 0;                 // threads waiting in a barrier or finished with the block
  std::atomic<bool> failed{false};
  std::string error;
  // block dispatch
  std::condition_variable dispatch_cv;
  std::condition_variable done_cv;
  unsigned long long block_number = 0;  // 1-based number of the block being run; 0 = none yet
  bool shutdown = false;
  uint3 current_block{0, 0, 0};
  int finished = 0;                // threads done with the current block
};

static Launch* g_launch = nullptr;  // one launch at a time per library (the launcher serialises)
static thread_local int t_linear = 0;  // linear thread index within the block
static thread_local int t_shuffle_parity = 0;  // which of the warp's two slot arrays is next

inline void fail_locked(Launch& l, const std::string& message);

inline std::string describe_site(int site) {
  return site == kExitSite ? std::string("the end of the kernel") : "line " + std::to_string(site);
}

// Arrive at `b` from call site `site` and wait until the barrier completes. Takes the lock.
inline void arrive_and_wait(Launch& l, Barrier& b, int site, const char* what) {
  std::unique_lock<std::mutex> lock(l.mutex);
  if (l.failed) throw Abort();
  if (b.arrived == 0) {
    b.site = site;
  } else if (b.site != site) {
    fail_locked(l, std::string(what) + ": thread " + std::to_string(t_linear) + " of block (" +
                       std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                       std::to_string(blockIdx.z) + ") reached " + describe_site(site) +
                       " while other threads wait at " + describe_site(b.site));
    throw Abort();
  }
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    l.blocked -= b.expected - 1;
    b.generation.fetch_add(1, std::memory_order_release);
    lock.unlock();
    futex_wake_all(b.generation);
    return;
  }
  ++l.blocked;
  if (l.blocked == l.num_threads) {
    fail_locked(l, std::string("deadlock: every thread waits and ") + what + " at " + describe_site(b.site) +
                       " can never complete (a thread returned early, or threads of one warp wait at "
                       "different barriers)");
    throw Abort();
  }
  const unsigned generation = b.generation.load(std::memory_order_relaxed);
  lock.unlock();
  while (b.generation.load(std::memory_order_acquire) == generation) {
    if (l.failed.load(std::memory_order_acquire)) throw Abort();
    futex_wait(b.generation, generation);
  }
}

inline void syncthreads(int site) { arrive_and_wait(*g_launch, g_launch->block_barrier, site, "__syncthreads"); }

inline void check_mask(unsigned mask, int site, const char* what) {
  Launch& l = *g_launch;
  const int warp = t_linear / 32;
  const int lanes = std::min(32, l.num_threads - warp * 32);
  const unsigned active = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  if (mask != active) {
    std::lock_guard<std::mutex> lock(l.mutex);
    char text[160];
    std::snprintf(text, sizeof text, "%s at line %d: mask 0x%08x, but the warp's threads are 0x%08x", what,
                  site, mask, active);
    fail_locked(l, text);
    throw Abort();
  }
}

template <typename T>
T shuffle(int site, unsigned mask, T value, int src_lane, const char* what) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type wider than 8 bytes");
  check_mask(mask, site, what);
  Launch& l = *g_launch;
  const int warp = t_linear / 32, lane = t_linear % 32;
  unsigned long long bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  // Two slot arrays used alternately: a lane can only write this array again two shuffles later,
  // after passing the next shuffle's barrier, which every lane reaches only after reading here.
  unsigned long long* slots = &l.warp_slots[(size_t)(2 * warp + (t_shuffle_parity ^= 1)) * 32];
  slots[lane] = bits;  // published to the warp by the barrier
  arrive_and_wait(l, l.warp_barriers[warp], site, what);
  const int lanes = l.warp_barriers[warp].expected;
  bits = slots[src_lane >= 0 && src_lane < lanes ? src_lane : lane];
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
inline int lane_id() { return t_linear % 32; }

inline void fail_locked(Launch& l, const std::string& message) {
  if (!l.failed) {
    l.error = message;
    l.failed.store(true, std::memory_order_release);
  }
  // Wake every waiter: bumping a generation makes its futex_wait return; they see `failed`.
  l.block_barrier.generation.fetch_add(1, std::memory_order_release);
  futex_wake_all(l.block_barrier.generation);
  for (Barrier& b : l.warp_barriers) {
    b.generation.fetch_add(1, std::memory_order_release);
    futex_wake_all(b.generation);
  }
  l.done_cv.notify_all();
}

// __shared__ variables live in the section emu_shared (except under ASan); the linker defines its
// bounds. Hidden, so each emulated library refills only its own; weak, for kernels without any.
extern "C" __attribute__((weak, visibility("hidden"))) char __start_emu_shared[];
extern "C" __attribute__((weak, visibility("hidden"))) char __stop_emu_shared[];

inline void fill_shared() {
  if (__start_emu_shared != nullptr && __stop_emu_shared != nullptr)
    std::memset(__start_emu_shared, 0x7f, (size_t)(__stop_emu_shared - __start_emu_shared));
}

// A thread is done with the current block: it counts as arriving at the block barrier from the
// kernel's end, so a thread that returns while others wait at __syncthreads is reported.
inline void finish_block(Launch& l, bool ok) {
  std::unique_lock<std::mutex> lock(l.mutex);
  if (ok && !l.failed) {
    Barrier& b = l.block_barrier;
    if (b.arrived == 0) {
      b.site = kExitSite;
    } else if (b.site != kExitSite) {
      fail_locked(l, "thread " + std::to_string(t_linear) + " returned from the kernel while other threads wait at "
                         "__syncthreads at " + describe_site(b.site));
    }
    if (!l.failed) {
      ++l.blocked;
      if (++b.arrived == b.expected) {
        b.arrived = 0;
        b.generation.fetch_add(1, std::memory_order_release);
      } else if (l.blocked == l.num_threads) {
        fail_locked(l, "deadlock: every thread has returned or waits, and a barrier at " + describe_site(b.site) +
                           " or a warp shuffle can never complete");
      }
    }
  }
  if (++l.finished == l.num_threads) l.done_cv.notify_all();
}

inline void worker(Launch& l, int linear, void (*body)(void*), void* ctx) {
  t_linear = linear;
  threadIdx = uint3{linear % l.block.x, (linear / l.block.x) % l.block.y, linear / (l.block.x * l.block.y)};
  blockDim = l.block;
  gridDim = l.grid;
  unsigned long long seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(l.mutex);
      l.dispatch_cv.wait(lock, [&] { return l.shutdown || l.block_number != seen; });
      if (l.shutdown) return;
      seen = l.block_number;
      blockIdx = l.current_block;
      t_shuffle_parity = 0;
    }
    bool ok = true;
    try {
      body(ctx);
    } catch (Abort&) {
      ok = false;
    } catch (std::exception& e) {
      std::lock_guard<std::mutex> lock(l.mutex);
      fail_locked(l, std::string("exception in kernel: ") + e.what());
      ok = false;
    }
    finish_block(l, ok);
  }
}

// Runs body(ctx) as a grid of blocks; returns 0, or 1 with a message in err.
inline int run_grid(dim3 grid, dim3 block, void (*body)(void*), void* ctx, char* err, int errlen) {
  const long long threads = (long long)block.x * block.y * block.z;
  if (threads <= 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535) {
    std::snprintf(err, (size_t)errlen, "invalid launch configuration: grid (%u,%u,%u) block (%u,%u,%u)", grid.x,
                  grid.y, grid.z, block.x, block.y, block.z);
    return 1;
  }
  Launch l;
  l.grid = grid;
  l.block = block;
  l.num_threads = (int)threads;
  l.block_barrier.expected = l.num_threads;
  const int num_warps = (l.num_threads + 31) / 32;
  l.warp_barriers = std::vector<Barrier>(num_warps);
  for (int w = 0; w < num_warps; ++w) l.warp_barriers[w].expected = std::min(32, l.num_threads - 32 * w);
  l.warp_slots.assign((size_t)num_warps * 2 * 32, 0);
  g_launch = &l;
  std::vector<std::thread> pool;
  pool.reserve(l.num_threads);
  for (int t = 0; t < l.num_threads; ++t) pool.emplace_back(worker, std::ref(l), t, body, ctx);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::unique_lock<std::mutex> lock(l.mutex);
        if (l.failed) goto done;
        l.finished = 0;
        l.blocked = 0;
        fill_shared();  // every worker is idle: nobody touches shared memory now
        l.current_block = uint3{x, y, z};
        ++l.block_number;
        l.dispatch_cv.notify_all();
        l.done_cv.wait(lock, [&] { return l.finished == l.num_threads; });
      }
done : {
  std::lock_guard<std::mutex> lock(l.mutex);
  l.shutdown = true;
  l.dispatch_cv.notify_all();
}
  for (std::thread& t : pool) t.join();
  g_launch = nullptr;
  if (l.failed) {
    std::snprintf(err, (size_t)errlen, "%s", l.error.c_str());
    return 1;
  }
  return 0;
}

// ---- kernel signatures and argument unpacking (kernelParams style: args[i] points at argument i) --
template <typename T>
struct TypeName;
#define EMU_TYPE_NAME(type, name) \
  template <>                     \
  struct TypeName<type> {         \
    static std::string get() { return name; } \
  };
EMU_TYPE_NAME(float, "float32")
EMU_TYPE_NAME(double, "float64")
EMU_TYPE_NAME(__half, "float16")
EMU_TYPE_NAME(__nv_bfloat16, "bfloat16")
EMU_TYPE_NAME(bool, "bool")
EMU_TYPE_NAME(signed char, "int8")
EMU_TYPE_NAME(unsigned char, "uint8")
EMU_TYPE_NAME(short, "int16")
EMU_TYPE_NAME(unsigned short, "uint16")
EMU_TYPE_NAME(int, "int32")
EMU_TYPE_NAME(unsigned, "uint32")
EMU_TYPE_NAME(long, "int64")
EMU_TYPE_NAME(long long, "int64")
EMU_TYPE_NAME(unsigned long, "uint64")
EMU_TYPE_NAME(unsigned long long, "uint64")
#undef EMU_TYPE_NAME
template <typename T>
struct TypeName<T*> {
  static std::string get() { return TypeName<typename std::remove_cv<T>::type>::get() + "*"; }
};

template <typename... A>
std::string signature(void (*)(A...)) {
  std::string s;
  ((s += (s.empty() ? "" : ","), s += TypeName<typename std::remove_cv<A>::type>::get()), ...);
  return s;
}

template <typename... A, std::size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_cv<A>::type*>(args[I])...);
}

template <typename... A>
int launch_kernel(void (*f)(A...), const unsigned* g, const unsigned* b, void** args, char* err, int errlen) {
  struct Ctx {
    void (*f)(A...);
    void** args;
  } ctx{f, args};
  return run_grid(dim3(g[0], g[1], g[2]), dim3(b[0], b[1], b[2]),
                  [](void* p) {
                    Ctx* c = static_cast<Ctx*>(p);
                    call(c->f, c->args, std::index_sequence_for<A...>{});
                  },
                  &ctx, err, errlen);
}

}  // namespace emu

#define __syncthreads() ::emu::syncthreads(__LINE__)
#define __shfl_xor_sync(mask, value, lane_mask, ...) \
  ::emu::shuffle(__LINE__, (mask), (value), ::emu::lane_id() ^ (int)(lane_mask), "__shfl_xor_sync")
#define __shfl_sync(mask, value, src_lane, ...) \
  ::emu::shuffle(__LINE__, (mask), (value), (int)(src_lane), "__shfl_sync")
#define __shfl_down_sync(mask, value, delta, ...) \
  ::emu::shuffle(__LINE__, (mask), (value), ::emu::lane_id() + (int)(delta), "__shfl_down_sync")

// Exports kernel `name` to the ctypes launcher: emu_signature_<name>() and emu_launch_<name>(...).
#define EMU_EXPORT(name)                                                                            \
  extern "C" __attribute__((visibility("default"))) const char* emu_signature_##name() {           \
    static const std::string s = ::emu::signature(&name);                                           \
    return s.c_str();                                                                               \
  }                                                                                                 \
  extern "C" __attribute__((visibility("default"))) int emu_launch_##name(                         \
      const unsigned* grid, const unsigned* block, void** args, char* err, int errlen) {            \
    return ::emu::launch_kernel(&name, grid, block, args, err, errlen);                             \
  }
