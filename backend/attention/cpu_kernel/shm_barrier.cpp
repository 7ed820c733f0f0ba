// The barrier of the tensor-parallel ranks' shared-memory collectives (backend/parallel/shm.py):
// each rank publishes the sequence number of the collective whose data it has written, then waits
// until every other rank has published it too. On this kind of host a gloo all-reduce over
// loopback TCP costs about a millisecond whatever its size (perf/RESULTS.md); this costs the
// ranks' skew plus a few cache-line transfers.
//
// Waiting spins (with the CPU's pause hint) for a short while, then yields the core on every
// check, so a peer sharing the core still gets to run. A peer process that is gone (checked with
// kill(pid, 0) every few thousand checks) ends the wait with -2, a wait longer than the timeout
// with -1; 0 when every rank has arrived.

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <ctime>
#include <sched.h>
#include <sys/types.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

static double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

extern "C" int shm_barrier(uint64_t* flags, int64_t stride_words, int rank, int size, uint64_t sequence,
                           const int32_t* peer_pids, double timeout_seconds) {
  __atomic_store_n(flags + rank * stride_words, sequence, __ATOMIC_RELEASE);
  const double started = now_seconds();
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const uint64_t* flag = flags + peer * stride_words;
    int64_t checks = 0;
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < sequence) {
      ++checks;
      if (checks < 20000) {
        cpu_relax();
        continue;
      }
      sched_yield();
      if (checks % 4096 == 0) {
        if (peer_pids[peer] > 0 && kill(peer_pids[peer], 0) != 0 && errno == ESRCH) return -2;
        if (now_seconds() - started > timeout_seconds) return -1;
      }
    }
  }
  return 0;
}
