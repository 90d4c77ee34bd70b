// The CUDA execution model on the host, linked into every emulated kernel module.
//
// Compiled WITHOUT -fsanitize=thread: it provides the __tsan_* callbacks that the
// instrumented kernel translation unit calls before every memory access, and must not
// call them itself.  Each module (.so) has its own copy of this state; launches of one
// module are serialized by a mutex, so plain globals are per-launch state.
//
// Execution: the blocks of a grid run one after another on the calling host thread.
// Within a block every CUDA thread is a fiber with its own stack; the scheduler resumes
// runnable fibers round-robin, and a fiber runs until it exits or waits at a rendezvous:
//   __syncthreads   completes when every thread of the block arrived or exited (sm_70+).
//   warp collective (shuffles, mma, ldmatrix) completes when all 32 lanes of the warp
//                   arrived; the last lane to arrive computes every lane's result.
//   cp.async        per thread: the source is read when the copy is issued, the shared
//                   destination is marked in flight (and holds 0xff poison) until the issuing
//                   thread's cp.async.wait_group/wait_all retires the copy's group; any access
//                   to in-flight bytes fails (see "asynchronous copies" below).
// A check failure records the message and switches straight back to the scheduler: the
// faulting access is never performed and the block's fibers are never resumed.
#include "cuda_emu.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <algorithm>
#include <climits>
#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#error "cuda_emu's fiber switch is x86-64 assembly"
#endif

#define TS_EMU_EXPORT extern "C"

namespace {

// Error kinds returned to Python (tests/gpu_emu/cuda_emu/__init__.py maps them to exceptions).
enum ErrorKind { OK = 0, RACE = 1, MISALIGNED = 2, OUT_OF_BOUNDS = 3, DIVERGENCE = 4, DEADLOCK = 5, UNSUPPORTED = 6,
                 ASYNC_COPY = 7 };

// ------------------------------------------------------------------------------- fibers
// ts_emu_switch(save, next): push the callee-saved registers, store the stack pointer in
// *save, load `next`, pop and return into whatever context saved it.
extern "C" void ts_emu_switch(void** save_sp, void* next_sp);
asm(R"(
  .text
  .p2align 4
  .hidden ts_emu_switch
  .type ts_emu_switch, @function
ts_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ts_emu_switch, .-ts_emu_switch
)");

constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kGuardBytes = 4096;           // PROT_NONE page below each stack: overflow faults
constexpr size_t kMaxDynamicSmem = 227 * 1024;

enum class State : unsigned char { Runnable, AtSyncthreads, AtWarp, Exited };

struct Fiber {
  void* sp;
  uint3 tid;
  int linear;
  State state;
};

// A warp collective in progress: what each lane deposited, what each lane gets back.
struct Warp {
  int lanes;                 // threads in this warp (< 32 only for a block's last warp)
  int arrived, exited;
  const char* op;            // the collective the arrived lanes wait at
  int is_bf16;
  unsigned long long value[32], result[32];
  int src_lane[32];
  unsigned a[32][4], b[32][2];
  float c[32][4], d[32][4];
  uintptr_t row_addr[32];    // ldmatrix: the row address each lane supplies
  unsigned frag[32][4];      // ldmatrix: the registers each lane receives
};

// Race shadow of one shared-memory byte: last writer and up to two readers in an epoch
// (the barrier interval); two distinct readers suffice to name one that differs from a writer.
// `async_by`: the thread whose cp.async into this byte has not been waited for (-1: none).
struct ShadowByte {
  unsigned write_epoch, read_epoch;
  short writer, reader0, reader1, async_by;
};

// One cp.async in flight: the bytes read from global memory when it was issued, and the
// cp.async-group it belongs to (0 until the thread's next cp.async.commit_group).
struct AsyncCopy {
  uintptr_t dst;
  int size, group;
  unsigned char data[16];
};
struct AsyncState {
  std::vector<AsyncCopy> copies;   // issued, not yet retired by a wait
  int committed = 0;               // groups committed so far (group ids are 1, 2, ...)
};

struct Range { uintptr_t lo, hi; };
struct SharedSymbol { size_t offset, size; std::string name; };

struct Launch {
  const char* kernel = "";
  void (*entry)(void**) = nullptr;
  void** args = nullptr;
  uint3 grid{}, block{}, block_idx{};
  int nthreads = 0, exited = 0, sync_arrived = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Fiber* current = nullptr;
  void* scheduler_sp = nullptr;
  std::vector<Range> buffers;
  size_t dynamic_bytes = 0;
  std::vector<AsyncState> async;   // per thread of the running block
  int error = OK;
  std::string message;
};

Launch L;
std::mutex g_launch_mutex;
char* g_stacks = nullptr;                      // fiber stacks, each kGuardBytes + kStackBytes
size_t g_stack_slots = 0;
// Static, not allocated at the first launch: a namespace-scope `extern __shared__` array
// becomes a pointer initialized when the module loads (see __init__.py).
alignas(128) char g_dynamic_smem[kMaxDynamicSmem];
std::vector<ShadowByte> g_shadow;              // static shared bytes, then dynamic
unsigned g_epoch = 0;                          // never reset: stale shadow entries never match
std::vector<SharedSymbol> g_shared_symbols;

}  // namespace

// Bounds of the static __shared__ section (see __shared__ in cuda_emu.h); weak because a
// module without static shared memory has no such section.
extern "C" char __start_ts_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_ts_emu_shared[] __attribute__((weak, visibility("hidden")));

namespace {

uintptr_t static_lo() { return (uintptr_t)__start_ts_emu_shared; }
size_t static_bytes() { return (size_t)(__stop_ts_emu_shared - __start_ts_emu_shared); }

char* stack_top(size_t slot) { return g_stacks + slot * (kGuardBytes + kStackBytes) + kGuardBytes + kStackBytes; }

bool ensure_stacks(size_t count) {
  if (count <= g_stack_slots) return true;
  if (g_stacks) munmap(g_stacks, g_stack_slots * (kGuardBytes + kStackBytes));
  const size_t bytes = count * (kGuardBytes + kStackBytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) { g_stacks = nullptr; g_stack_slots = 0; return false; }
  g_stacks = (char*)p;
  g_stack_slots = count;
  for (size_t i = 0; i < count; ++i) mprotect(g_stacks + i * (kGuardBytes + kStackBytes), kGuardBytes, PROT_NONE);
  return true;
}

std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

std::string where(const Fiber& f) {
  return format("kernel %s block (%u,%u,%u) thread (%u,%u,%u)", L.kernel, L.block_idx.x, L.block_idx.y,
                L.block_idx.z, f.tid.x, f.tid.y, f.tid.z);
}

std::string thread_name(int linear) {
  const uint3 t = L.fibers[linear].tid;
  return format("(%u,%u,%u)", t.x, t.y, t.z);
}

// "0-15,17": the lanes of `warp` for which pred(fiber) holds.
template <class Pred> std::string lane_list(int warp, Pred pred) {
  std::string out;
  int start = -1;
  for (int lane = 0; lane <= 32; ++lane) {
    const int idx = warp * 32 + lane;
    const bool in = lane < 32 && idx < L.nthreads && pred(L.fibers[idx]);
    if (in && start < 0) start = lane;
    if (!in && start >= 0) {
      if (!out.empty()) out += ",";
      out += lane - 1 > start ? format("%d-%d", start, lane - 1) : format("%d", start);
      start = -1;
    }
  }
  return out;
}

[[noreturn]] void yield_forever(Fiber* f) {
  ts_emu_switch(&f->sp, L.scheduler_sp);
  __builtin_unreachable();
}

// Record the failure and leave the fiber for good (the scheduler abandons the block).
[[noreturn]] void fail(int kind, std::string message) {
  L.error = kind;
  L.message = std::move(message);
  yield_forever(L.current);
}

void wait_for_scheduler(Fiber* f) {
  ts_emu_switch(&f->sp, L.scheduler_sp);
}

// ------------------------------------------------------------------------------- block barrier
void release_syncthreads() {
  for (Fiber& f : L.fibers)
    if (f.state == State::AtSyncthreads) f.state = State::Runnable;
  L.sync_arrived = 0;
  ++g_epoch;                                   // accesses on either side of a barrier never race
}

[[noreturn]] void exit_thread() {
  Fiber* f = L.current;
  Warp& w = L.warps[f->linear / 32];
  f->state = State::Exited;
  ++L.exited;
  ++w.exited;
  if (w.arrived > 0)
    fail(DIVERGENCE, format("barrier divergence in kernel %s block (%u,%u,%u) warp %d: thread %s exited while "
                            "lanes %s wait at %s (a full-mask warp collective needs every lane)",
                            L.kernel, L.block_idx.x, L.block_idx.y, L.block_idx.z, f->linear / 32,
                            thread_name(f->linear).c_str(),
                            lane_list(f->linear / 32, [](const Fiber& g) { return g.state == State::AtWarp; }).c_str(),
                            w.op));
  if (L.sync_arrived > 0 && L.sync_arrived + L.exited == L.nthreads) release_syncthreads();
  yield_forever(f);
}

void fiber_main() {
  L.entry(L.args);
  exit_thread();
}

// ------------------------------------------------------------------------------- warp collectives
// Arrive at collective `op`; returns once all 32 lanes have arrived and results are ready.
// `deposit(lane)` stores this lane's operands, `compute(warp)` runs once, by the last lane.
template <class Deposit, class Compute> void warp_collective(const char* op, Deposit deposit, Compute compute) {
  Fiber* f = L.current;
  const int warp_id = f->linear / 32, lane = f->linear % 32;
  Warp& w = L.warps[warp_id];
  auto place = [&] {
    return format("kernel %s block (%u,%u,%u) warp %d", L.kernel, L.block_idx.x, L.block_idx.y, L.block_idx.z,
                  warp_id);
  };
  if (w.lanes < 32)
    fail(DIVERGENCE, format("%s at %s: the warp has only %d threads (blockDim %u,%u,%u) but the full mask "
                            "0xffffffff names lanes %d-31", op, place().c_str(), w.lanes, L.block.x, L.block.y,
                            L.block.z, w.lanes));
  if (w.exited > 0)
    fail(DIVERGENCE, format("barrier divergence at %s in %s: lane %d arrived but lanes %s have exited", op,
                            place().c_str(), lane,
                            lane_list(warp_id, [](const Fiber& g) { return g.state == State::Exited; }).c_str()));
  if (w.arrived > 0 && w.op != op)
    fail(DIVERGENCE, format("barrier divergence in %s: lane %d reached %s while lanes %s wait at %s",
                            place().c_str(), lane, op,
                            lane_list(warp_id, [](const Fiber& g) { return g.state == State::AtWarp; }).c_str(),
                            w.op));
  w.op = op;
  deposit(w, lane);
  f->state = State::AtWarp;
  if (++w.arrived == 32) {
    compute(w);
    w.arrived = 0;
    for (int i = 0; i < 32; ++i) L.fibers[warp_id * 32 + i].state = State::Runnable;
  } else {
    wait_for_scheduler(f);
  }
}

const char* shfl_name(int kind) {
  switch (kind) {
    case TS_EMU_SHFL_IDX: return "__shfl_sync";
    case TS_EMU_SHFL_UP: return "__shfl_up_sync";
    case TS_EMU_SHFL_DOWN: return "__shfl_down_sync";
    default: return "__shfl_xor_sync";
  }
}

// The source lane of a shuffle, CUDA's rule: lanes form segments of `width`; a source
// outside the lane's own segment (past it for up/down/xor) yields the lane's own value.
int shfl_source(int lane, int kind, int arg, int width) {
  const int seg = lane & ~(width - 1);
  switch (kind) {
    case TS_EMU_SHFL_IDX: return seg + (arg & (width - 1));
    case TS_EMU_SHFL_UP: return lane - arg >= seg ? lane - arg : lane;
    case TS_EMU_SHFL_DOWN: return lane + arg < seg + width ? lane + arg : lane;
    default: { const int src = lane ^ arg; return src < seg + width ? src : lane; }
  }
}

// ------------------------------------------------------------------------------- mma.sync m16n8k16
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type").  For lane l, g = l / 4, t = l % 4;
// each 32-bit A/B register packs two 16-bit elements, the lower half holding the lower column
// (A) or lower k (B):
//   A (16x16, row-major):  a0 = A[g][2t, 2t+1]     a1 = A[g+8][2t, 2t+1]
//                          a2 = A[g][2t+8, 2t+9]   a3 = A[g+8][2t+8, 2t+9]
//   B (16x8,  "col"):      b0 = B[2t, 2t+1][g]     b1 = B[2t+8, 2t+9][g]
//   C/D (16x8, f32):       c0, c1 = C[g][2t, 2t+1] c2, c3 = C[g+8][2t, 2t+1]
// Products of two f16 (or bf16) are exact in f32; the sum is accumulated in f32, k ascending.
// D = A B + C into each lane's C/D fragment (c0, c1 = row g, cols 2t, 2t+1; c2, c3 = row g+8).
template <int K> void accumulate(Warp& w, const float (&A)[16][K], const float (&B)[K][8]) {
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r >> 1) * 8, col = 2 * t + (r & 1);
      float acc = w.c[l][r];
      for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
      w.d[l][r] = acc;
    }
  }
}

float unpack_half(unsigned reg, int high, int is_bf16) {
  const unsigned short bits = (unsigned short)(high ? reg >> 16 : reg & 0xffffu);
  return is_bf16 ? ts_emu_bf16_bits_to_f32(bits) : ts_emu_f16_bits_to_f32(bits);
}

void compute_mma(Warp& w) {
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = unpack_half(w.a[l][0], h, w.is_bf16);
      A[g + 8][2 * t + h] = unpack_half(w.a[l][1], h, w.is_bf16);
      A[g][2 * t + 8 + h] = unpack_half(w.a[l][2], h, w.is_bf16);
      A[g + 8][2 * t + 8 + h] = unpack_half(w.a[l][3], h, w.is_bf16);
      B[2 * t + h][g] = unpack_half(w.b[l][0], h, w.is_bf16);
      B[2 * t + 8 + h][g] = unpack_half(w.b[l][1], h, w.is_bf16);
    }
  }
  accumulate(w, A, B);
}

// ------------------------------------------------------------------------------- mma.sync m16n8k8 tf32
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k8" with .tf32): each register holds one element, g = l / 4, t = l % 4:
//   A (16x8, row-major):  a0 = A[g][t]   a1 = A[g+8][t]   a2 = A[g][t+4]   a3 = A[g+8][t+4]
//   B (8x8,  "col"):      b0 = B[t][g]   b1 = B[t+4][g]
//   C/D (16x8, f32):      as m16n8k16: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// A .tf32 operand is a 32-bit register of which the ISA fixes only "at least 10 mantissa bits"
// (its layout is implementation-defined; cvt.rna.tf32.f32 produces it).  sm_80/sm_90 tensor
// cores read the sign, exponent and top 10 mantissa bits and ignore the low 13, so an f32
// passed without the cvt is truncated toward zero; that is modelled here (CUTLASS's
// round_half_ulp_truncate conversion relies on it).  Products of two tf32 values are exact in
// f32; the sum is accumulated in f32, k ascending (the hardware aligns the products to the
// largest and truncates: a few f32 ulps apart at most, not modelled).
float tf32_operand(unsigned reg) { return std::bit_cast<float>(reg & 0xffffe000u); }

// How the tf32 MMA sums (ts_emu_set_tf32_accumulation): 0, sequential f32 adds rounded to
// nearest (as the f16/bf16 model); 1, a model of the A100's tensor cores after Fasi, Higham,
// Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores" (PeerJ CS, 2021): for each
// group of four k, c and the four exact products are aligned to the largest in magnitude with
// no guard bits (each truncated toward zero at that one's f32 ulp), summed, and the sum is
// truncated toward zero to f32.  Biased toward zero, so an upper estimate of the hardware's
// accumulation error, for checking that a kernel's accuracy does not rest on round-to-nearest.
int g_tf32_accumulation = 0;

float truncate_to_f32(double x) {
  float r = (float)x;
  if (std::isfinite(r) && fabs((double)r) > fabs(x)) r = nextafterf(r, 0.f);
  return r;
}

float fused_group(float c, const float* a, const float* b, int n) {
  double terms[5] = {c, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) terms[i + 1] = (double)a[i] * (double)b[i];   // exact: 11 x 11 bits
  int emax = INT32_MIN;
  for (int i = 0; i <= n; ++i) {
    if (!std::isfinite(terms[i])) return (float)(terms[0] + terms[1] + terms[2] + terms[3] + terms[4]);
    if (terms[i] != 0) emax = std::max(emax, std::ilogb(terms[i]));
  }
  if (emax == INT32_MIN) return c + 0.f;
  const double ulp = std::ldexp(1.0, emax - 23);
  double sum = 0;
  for (int i = 0; i <= n; ++i) sum += std::trunc(terms[i] / ulp) * ulp;   // exact: multiples of ulp below 2^28 ulp
  return truncate_to_f32(sum);
}

void compute_mma_tf32(Warp& w) {
  float A[16][8], B[8][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    A[g][t] = tf32_operand(w.a[l][0]);
    A[g + 8][t] = tf32_operand(w.a[l][1]);
    A[g][t + 4] = tf32_operand(w.a[l][2]);
    A[g + 8][t + 4] = tf32_operand(w.a[l][3]);
    B[t][g] = tf32_operand(w.b[l][0]);
    B[t + 4][g] = tf32_operand(w.b[l][1]);
  }
  if (!g_tf32_accumulation) return accumulate(w, A, B);
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r >> 1) * 8, col = 2 * t + (r & 1);
      float acc = w.c[l][r], bk[8];
      for (int k = 0; k < 8; ++k) bk[k] = B[k][col];
      acc = fused_group(acc, A[row], bk, 4);
      w.d[l][r] = fused_group(acc, A[row] + 4, bk + 4, 4);
    }
  }
}

// ------------------------------------------------------------------------------- memory checks
std::string shared_location(size_t offset) {
  const size_t nstatic = static_bytes();
  if (offset >= nstatic) return format("dynamic shared memory +%zu", offset - nstatic);
  for (const SharedSymbol& s : g_shared_symbols)
    if (offset >= s.offset && offset < s.offset + s.size)
      return format("__shared__ %s +%zu (static shared offset %zu)", s.name.c_str(), offset - s.offset, offset);
  return format("static shared memory +%zu", offset);
}

// An access to shared bytes that a cp.async is still copying into: the PTX ISA makes the
// copy's writes visible only once its group is waited for (cp.async.wait_group/wait_all by the
// issuing thread, then a barrier for the other threads), so what such a read sees is undefined.
void check_in_flight(size_t offset, size_t size, const char* what, uintptr_t addr) {
  for (size_t i = 0; i < size; ++i) {
    const short by = g_shadow[offset + i].async_by;
    if (by >= 0)
      fail(ASYNC_COPY, format("cp.async not waited for in kernel %s block (%u,%u,%u): thread %s %s %zu bytes at %s "
                              "(address %#lx) while the cp.async that thread %s issued into it is in flight (no "
                              "cp.async.wait_group/wait_all retired its group)",
                              L.kernel, L.block_idx.x, L.block_idx.y, L.block_idx.z, thread_name(L.current->linear).c_str(),
                              what, size, shared_location(offset + i).c_str(), (unsigned long)(addr + i),
                              thread_name(by).c_str()));
  }
}

void check_race(size_t offset, size_t size, bool write, uintptr_t addr) {
  const int me = L.current->linear;
  for (size_t i = 0; i < size; ++i) {
    ShadowByte& s = g_shadow[offset + i];
    int other = -1;
    const char* kind = nullptr;
    const char* other_did = nullptr;
    if (s.write_epoch == g_epoch && s.writer != me) {
      other = s.writer;
      kind = write ? "write-after-write" : "read-after-write";
      other_did = "wrote";
    } else if (write && s.read_epoch == g_epoch) {
      other = s.reader0 != me ? s.reader0 : s.reader1;
      kind = "write-after-read";
      other_did = "read";
    }
    if (other >= 0)
      fail(RACE, format("shared-memory race (%s) in kernel %s block (%u,%u,%u): thread %s %s %zu bytes at %s "
                        "(address %#lx), which thread %s %s with no __syncthreads() in between",
                        kind, L.kernel, L.block_idx.x, L.block_idx.y, L.block_idx.z,
                        thread_name(me).c_str(), write ? "writes" : "reads", size, shared_location(offset + i).c_str(),
                        (unsigned long)(addr + i), thread_name(other).c_str(), other_did));
  }
  for (size_t i = 0; i < size; ++i) {
    ShadowByte& s = g_shadow[offset + i];
    if (write) {
      s.writer = (short)me;
      s.write_epoch = g_epoch;
    } else if (s.read_epoch != g_epoch) {
      s.read_epoch = g_epoch;
      s.reader0 = (short)me;
      s.reader1 = -1;
    } else if (s.reader0 != me && s.reader1 < 0) {
      s.reader1 = (short)me;
    }
  }
}

[[noreturn]] void fail_out_of_bounds(uintptr_t a, size_t size, bool write, const char* detail) {
  fail(OUT_OF_BOUNDS, format("out-of-bounds %s of %zu bytes at %#lx in %s: %s", write ? "write" : "read", size,
                             (unsigned long)a, where(*L.current).c_str(), detail));
}

[[noreturn]] void fail_global_out_of_bounds(uintptr_t a, size_t size, bool write) {
  const Range* nearest = nullptr;
  uintptr_t best = ~(uintptr_t)0;
  for (const Range& r : L.buffers) {
    const uintptr_t dist = a >= r.hi ? a - r.hi + 1 : (a < r.lo ? r.lo - a : 0);
    if (dist < best) { best = dist; nearest = &r; }
  }
  std::string detail = "the address is in no device allocation";
  if (nearest) {
    const size_t n = nearest->hi - nearest->lo;
    detail += a >= nearest->lo
        ? format("; nearest is [%#lx, %#lx) (%zu bytes), the access ends %zu bytes past its end",
                 (unsigned long)nearest->lo, (unsigned long)nearest->hi, n, (size_t)(a + size - nearest->hi))
        : format("; nearest is [%#lx, %#lx) (%zu bytes), the access starts %zu bytes before it",
                 (unsigned long)nearest->lo, (unsigned long)nearest->hi, n, (size_t)(nearest->lo - a));
  }
  fail_out_of_bounds(a, size, write, detail.c_str());
}

// Called (through the __tsan_* hooks) before every memory access of the kernel code.
inline void check_access(const void* addr, size_t size, bool write, bool check_alignment) {
  Fiber* f = L.current;
  if (!f) return;                               // not inside a launch (module constructors)
  const uintptr_t a = (uintptr_t)addr;
  if (a - (uintptr_t)g_stacks < g_stack_slots * (kGuardBytes + kStackBytes)) return;   // registers / local memory
  if (check_alignment && (a & (size - 1)))
    fail(MISALIGNED, format("misaligned %zu-byte %s at %#lx (address %% %zu = %zu) in %s", size,
                            write ? "write" : "read", (unsigned long)a, size, (size_t)(a & (size - 1)),
                            where(*f).c_str()));
  const uintptr_t slo = static_lo();
  const size_t nstatic = static_bytes();
  if (a - slo < nstatic) {
    if (a + size > slo + nstatic) fail_out_of_bounds(a, size, write, "the access runs past static shared memory");
    check_in_flight(a - slo, size, write ? "writes" : "reads", a);
    check_race(a - slo, size, write, a);
    return;
  }
  const uintptr_t dlo = (uintptr_t)g_dynamic_smem;
  if (a - dlo < kMaxDynamicSmem) {
    if (a + size > dlo + L.dynamic_bytes)
      fail_out_of_bounds(a, size, write, format("dynamic shared memory is %zu bytes (shared_mem at launch); the access "
                                                "is at offset %zu", L.dynamic_bytes, (size_t)(a - dlo)).c_str());
    check_in_flight(nstatic + (a - dlo), size, write ? "writes" : "reads", a);
    check_race(nstatic + (a - dlo), size, write, a);
    return;
  }
  for (const Range& r : L.buffers)
    if (a >= r.lo && a + size <= r.hi) return;
  fail_global_out_of_bounds(a, size, write);
}

// Offset of [a, a + size) in the block's shared memory (static, then dynamic), or SIZE_MAX when
// the range is not wholly inside it.
size_t shared_offset(uintptr_t a, size_t size) {
  const uintptr_t slo = static_lo(), dlo = (uintptr_t)g_dynamic_smem;
  const size_t nstatic = static_bytes();
  if (a - slo < nstatic) return a + size <= slo + nstatic ? a - slo : SIZE_MAX;
  if (a - dlo < L.dynamic_bytes) return a + size <= dlo + L.dynamic_bytes ? nstatic + (a - dlo) : SIZE_MAX;
  return SIZE_MAX;
}

bool in_global_buffer(uintptr_t a, size_t size) {
  for (const Range& r : L.buffers)
    if (a >= r.lo && a + size <= r.hi) return true;
  return false;
}

// ------------------------------------------------------------------------------- ldmatrix
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 (PTX ISA, "Warp-level matrix load
// instruction: ldmatrix"): lane 8i + j supplies the shared address of row j of matrix i (16
// bytes: eight b16 elements; lanes past 8 * num supply none).  Lane l receives in register i
// the 32 bits of row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of matrix i (the lower element
// in the lower half) -- with .trans, of the transposed matrix: elements (2 (l % 4), l / 4) and
// (2 (l % 4) + 1, l / 4).  These are exactly mma.m16n8k16's A and B fragments.
const char* ldmatrix_name(int num, int trans) {
  static const char* names[2][5] = {
      {"", "ldmatrix.x1", "ldmatrix.x2", "", "ldmatrix.x4"},
      {"", "ldmatrix.x1.trans", "ldmatrix.x2.trans", "", "ldmatrix.x4.trans"}};
  return names[trans ? 1 : 0][num];
}

void compute_ldmatrix(Warp& w, int num, int trans) {
  unsigned short m[4][8][8];
  for (int i = 0; i < num; ++i)
    for (int j = 0; j < 8; ++j) memcpy(m[i][j], (const void*)w.row_addr[8 * i + j], 16);
  for (int l = 0; l < 32; ++l) {
    const int r = l >> 2, c = 2 * (l & 3);
    for (int i = 0; i < num; ++i) {
      const unsigned lo = trans ? m[i][c][r] : m[i][r][c];
      const unsigned hi = trans ? m[i][c + 1][r] : m[i][r][c + 1];
      w.frag[l][i] = lo | (hi << 16);
    }
  }
}

// ------------------------------------------------------------------------------- asynchronous copies
// cp.async.{ca,cg}.shared.global [dst], [src], cp-size{, src-size} (PTX ISA, "Data Movement and
// Conversion Instructions: cp.async"): copies cp-size bytes (4, 8 or 16; .cg: 16 only), the first
// src-size of them from global memory and zeros after, both addresses aligned to cp-size.  The
// copy belongs to the next cp.async.commit_group of its thread; cp.async.wait_group N returns
// once at most the N most recent committed groups of the thread are pending (copies not yet
// committed belong to no group and are not waited for); cp.async.wait_all is commit_group
// followed by wait_group 0.  Completed writes are visible to the issuing thread; other threads
// need a barrier after the wait, which the race shadow enforces (a retired copy is a write by
// its issuing thread in the epoch of the wait).  Here the source is read at issue, and the
// destination holds 0xff (a NaN in f16/bf16) and is marked in flight until the wait retires it.
void retire_copy(const AsyncCopy& c) {
  const size_t off = shared_offset(c.dst, c.size);
  check_race(off, c.size, true, c.dst);
  memcpy((void*)c.dst, c.data, c.size);
  for (int i = 0; i < c.size; ++i) g_shadow[off + i].async_by = -1;
}

void wait_groups(int n, const char* op) {
  Fiber* f = L.current;
  if (n < 0 || n > 7)
    fail(UNSUPPORTED, format("%s %d in %s: N is an integer constant in [0, 7] here", op, n, where(*f).c_str()));
  AsyncState& st = L.async[f->linear];
  const int done = st.committed - n;      // groups 1..done must be complete
  std::vector<AsyncCopy> keep;
  for (const AsyncCopy& c : st.copies) {
    if (c.group != 0 && c.group <= done) retire_copy(c);
    else keep.push_back(c);
  }
  st.copies.swap(keep);
}

// ------------------------------------------------------------------------------- scheduler
std::string deadlock_report() {
  std::string out;
  for (int w = 0; w * 32 < L.nthreads; ++w) {
    const std::string sync = lane_list(w, [](const Fiber& f) { return f.state == State::AtSyncthreads; });
    const std::string coll = lane_list(w, [](const Fiber& f) { return f.state == State::AtWarp; });
    const std::string gone = lane_list(w, [](const Fiber& f) { return f.state == State::Exited; });
    out += format("; warp %d:", w);
    if (!sync.empty()) out += " lanes " + sync + " at __syncthreads()";
    if (!coll.empty()) out += " lanes " + coll + " at " + std::string(L.warps[w].op);
    if (!gone.empty()) out += " lanes " + gone + " exited";
  }
  return out;
}

int run_block() {
  const size_t nstatic = static_bytes();
  memset(__start_ts_emu_shared, 0xff, nstatic);              // uninitialized shared reads show up
  memset(g_dynamic_smem, 0xff, L.dynamic_bytes);
  for (ShadowByte& s : g_shadow) s.async_by = -1;           // copies the previous block left in flight
  L.async.assign(L.nthreads, AsyncState{});
  ++g_epoch;
  L.exited = L.sync_arrived = 0;
  for (Warp& w : L.warps) w.arrived = w.exited = 0;
  for (int i = 0; i < L.nthreads; ++i) {
    Fiber& f = L.fibers[i];
    void** sp = (void**)stack_top(i);
    *--sp = nullptr;                          // fiber_main's return address: it never returns
    *--sp = (void*)&fiber_main;               // where ts_emu_switch's `ret` enters the fiber
    for (int r = 0; r < 6; ++r) *--sp = nullptr;   // callee-saved registers popped by ts_emu_switch
    f.sp = sp;
    f.state = State::Runnable;
  }
  while (L.exited < L.nthreads) {
    bool ran = false;
    for (Fiber& f : L.fibers) {
      if (f.state != State::Runnable) continue;
      ran = true;
      L.current = &f;
      ts_emu_switch(&L.scheduler_sp, f.sp);
      L.current = nullptr;
      if (L.error) return L.error;
    }
    if (!ran) {
      L.message = format("deadlock in kernel %s block (%u,%u,%u): no thread can proceed%s", L.kernel,
                         L.block_idx.x, L.block_idx.y, L.block_idx.z, deadlock_report().c_str());
      return L.error = DEADLOCK;
    }
  }
  return OK;
}

}  // namespace

// ------------------------------------------------------------------------------- device API
extern "C" {
uint3 ts_emu_thread_idx(void) { return L.current->tid; }
uint3 ts_emu_block_idx(void) { return L.block_idx; }
uint3 ts_emu_block_dim(void) { return L.block; }
uint3 ts_emu_grid_dim(void) { return L.grid; }
void* ts_emu_dynamic_smem(void) { return g_dynamic_smem; }

void ts_emu_syncthreads(void) {
  Fiber* f = L.current;
  f->state = State::AtSyncthreads;
  if (++L.sync_arrived + L.exited == L.nthreads) release_syncthreads();
  else wait_for_scheduler(f);
}

unsigned long long ts_emu_shfl(unsigned mask, unsigned long long bits, int kind, int arg, int width) {
  const char* op = shfl_name(kind);
  if (mask != 0xffffffffu)
    fail(UNSUPPORTED, format("unsupported mask %#x for %s in %s: the emulator implements full-warp shuffles "
                             "(0xffffffff) only", mask, op, where(*L.current).c_str()));
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail(UNSUPPORTED, format("%s width %d in %s: must be a power of two <= 32", op, width, where(*L.current).c_str()));
  const int lane = L.current->linear % 32;
  Warp& w = L.warps[L.current->linear / 32];
  warp_collective(
      op,
      [&](Warp& ww, int l) { ww.value[l] = bits; ww.src_lane[l] = shfl_source(l, kind, arg, width); },
      [](Warp& ww) { for (int l = 0; l < 32; ++l) ww.result[l] = ww.value[ww.src_lane[l]]; });
  return w.result[lane];
}

void ts_emu_mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, int is_bf16) {
  const int lane = L.current->linear % 32;
  Warp& w = L.warps[L.current->linear / 32];
  const char* op = is_bf16 ? "mma.sync.m16n8k16 (bf16)" : "mma.sync.m16n8k16 (f16)";
  warp_collective(
      op,
      [&](Warp& ww, int l) {
        ww.is_bf16 = is_bf16;
        for (int i = 0; i < 4; ++i) { ww.a[l][i] = a[i]; ww.c[l][i] = d[i]; }
        ww.b[l][0] = b[0];
        ww.b[l][1] = b[1];
      },
      compute_mma);
  for (int i = 0; i < 4; ++i) d[i] = w.d[lane][i];
}

void ts_emu_mma_m16n8k8_tf32(float* d, const unsigned* a, const unsigned* b) {
  const int lane = L.current->linear % 32;
  Warp& w = L.warps[L.current->linear / 32];
  warp_collective(
      "mma.sync.m16n8k8 (tf32)",
      [&](Warp& ww, int l) {
        for (int i = 0; i < 4; ++i) { ww.a[l][i] = a[i]; ww.c[l][i] = d[i]; }
        ww.b[l][0] = b[0];
        ww.b[l][1] = b[1];
      },
      compute_mma_tf32);
  for (int i = 0; i < 4; ++i) d[i] = w.d[lane][i];
}

void ts_emu_ldmatrix(unsigned* r, const void* p, int num, int trans) {
  Fiber* f = L.current;
  const int lane = f->linear % 32;
  Warp& w = L.warps[f->linear / 32];
  if (num != 1 && num != 2 && num != 4)
    fail(UNSUPPORTED, format("ldmatrix .x%d in %s: .num is x1, x2 or x4", num, where(*f).c_str()));
  const char* op = ldmatrix_name(num, trans);
  const uintptr_t a = (uintptr_t)p;
  if (lane < 8 * num) {                   // this lane supplies row lane % 8 of matrix lane / 8
    if (shared_offset(a, 1) == SIZE_MAX)
      fail(OUT_OF_BOUNDS, format("%s in %s: lane %d supplies row address %#lx (row %d of matrix %d), which is not in "
                                 "the block's shared memory (%zu static + %zu dynamic bytes)", op, where(*f).c_str(),
                                 lane, (unsigned long)a, lane % 8, lane / 8, static_bytes(), L.dynamic_bytes));
    check_access(p, 16, false, true);     // a 16-byte row: aligned, in bounds, in no race, not in flight
  }
  warp_collective(
      op, [&](Warp& ww, int l) { ww.row_addr[l] = a; },
      [&](Warp& ww) { compute_ldmatrix(ww, num, trans); });
  for (int i = 0; i < num; ++i) r[i] = w.frag[lane][i];
}

void ts_emu_cp_async(void* dst, const void* src, int cp_size, int src_size, int cg) {
  Fiber* f = L.current;
  const char* op = cg ? "cp.async.cg.shared.global" : "cp.async.ca.shared.global";
  if (cg ? cp_size != 16 : (cp_size != 4 && cp_size != 8 && cp_size != 16))
    fail(ASYNC_COPY, format("%s with cp-size %d in %s: .ca copies 4, 8 or 16 bytes, .cg 16", op, cp_size,
                            where(*f).c_str()));
  if (src_size < 0 || src_size > cp_size)
    fail(ASYNC_COPY, format("%s in %s: src-size %d outside [0, cp-size %d] (undefined behaviour)", op,
                            where(*f).c_str(), src_size, cp_size));
  const uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if ((d | s) & (cp_size - 1))
    fail(MISALIGNED, format("misaligned %s of %d bytes in %s: dst %#lx %% %d = %lu, src %#lx %% %d = %lu (both "
                            "must be aligned to cp-size)", op, cp_size, where(*f).c_str(), (unsigned long)d, cp_size,
                            (unsigned long)(d & (cp_size - 1)), (unsigned long)s, cp_size,
                            (unsigned long)(s & (cp_size - 1))));
  const size_t off = shared_offset(d, cp_size);
  if (off == SIZE_MAX)
    fail_out_of_bounds(d, cp_size, true, format("%s: the destination is not inside the block's shared memory "
                                                "(%zu static + %zu dynamic bytes)", op, static_bytes(),
                                                L.dynamic_bytes).c_str());
  if (src_size > 0 && (shared_offset(s, 1) != SIZE_MAX || !in_global_buffer(s, src_size)))
    fail_global_out_of_bounds(s, src_size, false);
  check_in_flight(off, cp_size, "issues a cp.async that writes", d);   // two copies in flight into one byte
  check_race(off, cp_size, true, d);     // the destination is written from now on
  AsyncCopy c{d, cp_size, 0, {}};
  memcpy(c.data, src, src_size);
  memset(c.data + src_size, 0, cp_size - src_size);
  memset(dst, 0xff, cp_size);
  for (int i = 0; i < cp_size; ++i) g_shadow[off + i].async_by = (short)f->linear;
  L.async[f->linear].copies.push_back(c);
}

void ts_emu_cp_async_commit(void) {
  AsyncState& st = L.async[L.current->linear];
  ++st.committed;                         // an empty group is a group too
  for (AsyncCopy& c : st.copies)
    if (c.group == 0) c.group = st.committed;
}

void ts_emu_cp_async_wait(int n) { wait_groups(n, "cp.async.wait_group"); }

void ts_emu_cp_async_wait_all(void) {
  ts_emu_cp_async_commit();
  wait_groups(0, "cp.async.wait_all");
}
}

// ------------------------------------------------------------------------------- instrumentation hooks
// GCC's -fsanitize=thread calls these before each access; N-byte hooks see naturally
// typed accesses (alignment checked: the GPU faults on misaligned loads), the unaligned
// and range hooks see packed/aggregate accesses (no alignment requirement).
#define TS_EMU_HOOKS(N)                                                                                   \
  TS_EMU_EXPORT void __tsan_read##N(void* p) { check_access(p, N, false, true); }                         \
  TS_EMU_EXPORT void __tsan_write##N(void* p) { check_access(p, N, true, true); }                         \
  TS_EMU_EXPORT void __tsan_unaligned_read##N(void* p) { check_access(p, N, false, false); }              \
  TS_EMU_EXPORT void __tsan_unaligned_write##N(void* p) { check_access(p, N, true, false); }              \
  TS_EMU_EXPORT void __tsan_volatile_read##N(void* p) { check_access(p, N, false, true); }                \
  TS_EMU_EXPORT void __tsan_volatile_write##N(void* p) { check_access(p, N, true, true); }
TS_EMU_HOOKS(1)
TS_EMU_HOOKS(2)
TS_EMU_HOOKS(4)
TS_EMU_HOOKS(8)
TS_EMU_HOOKS(16)
#undef TS_EMU_HOOKS
TS_EMU_EXPORT void __tsan_read_range(void* p, unsigned long size) { if (size) check_access(p, size, false, false); }
TS_EMU_EXPORT void __tsan_write_range(void* p, unsigned long size) { if (size) check_access(p, size, true, false); }
TS_EMU_EXPORT void __tsan_func_entry(void*) {}
TS_EMU_EXPORT void __tsan_func_exit(void) {}
TS_EMU_EXPORT void __tsan_init(void) {}

// ------------------------------------------------------------------------------- host API (ctypes)
TS_EMU_EXPORT unsigned long long ts_emu_static_smem_bytes(void) { return static_bytes(); }

// The tf32 MMA's summation model (g_tf32_accumulation); returns the previous one.
TS_EMU_EXPORT int ts_emu_set_tf32_accumulation(int model) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const int before = g_tf32_accumulation;
  g_tf32_accumulation = model;
  return before;
}

// Names static __shared__ variables in race messages (offsets within the section).
TS_EMU_EXPORT void ts_emu_name_shared(unsigned long long offset, unsigned long long size, const char* name) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g_shared_symbols.push_back({(size_t)offset, (size_t)size, name});
}

// Run a grid.  `buffers` holds (pointer, bytes) pairs of the device memory the kernel may
// touch.  Blocks run one at a time in an order shuffled from `seed` (a GPU runs them in no
// set order, concurrently): a kernel that relies on block order or on another block's
// writes gets a wrong result here.  Returns an ErrorKind; on failure `message` holds a
// readable report.
TS_EMU_EXPORT int ts_emu_launch(const char* kernel, void (*entry)(void**), void** args, const unsigned* grid,
                                const unsigned* block, unsigned long long dynamic_bytes,
                                const unsigned long long* buffers, int nbuffers, char* message, int message_len,
                                unsigned long long seed) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  L.kernel = kernel;
  L.entry = entry;
  L.args = args;
  L.grid = {grid[0], grid[1], grid[2]};
  L.block = {block[0], block[1], block[2]};
  L.nthreads = (int)(block[0] * block[1] * block[2]);
  L.dynamic_bytes = dynamic_bytes;
  L.error = OK;
  L.message.clear();
  L.buffers.clear();
  for (int i = 0; i < nbuffers; ++i) L.buffers.push_back({buffers[2 * i], buffers[2 * i] + buffers[2 * i + 1]});
  if (!ensure_stacks(L.nthreads)) {
    snprintf(message, message_len, "cuda_emu: cannot map %d fiber stacks", L.nthreads);
    return UNSUPPORTED;
  }
  g_shadow.assign(static_bytes() + dynamic_bytes, ShadowByte{0, 0, -1, -1, -1, -1});
  L.fibers.assign(L.nthreads, Fiber{});
  for (int i = 0; i < L.nthreads; ++i) {
    const unsigned x = i % block[0], y = (i / block[0]) % block[1], z = i / (block[0] * block[1]);
    L.fibers[i].tid = {x, y, z};
    L.fibers[i].linear = i;
  }
  L.warps.assign((L.nthreads + 31) / 32, Warp{});
  for (size_t w = 0; w < L.warps.size(); ++w) L.warps[w].lanes = min(32, L.nthreads - (int)w * 32);
  const unsigned long long nx = grid[0], nxy = nx * grid[1], nblocks = nxy * grid[2];
  std::vector<unsigned long long> order(nblocks);
  for (unsigned long long i = 0; i < nblocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  int status = OK;
  unsigned long long ran = 0;
  while (ran < nblocks && status == OK) {
    const unsigned long long b = order[ran++];
    L.block_idx = {(unsigned)(b % nx), (unsigned)(b / nx % grid[1]), (unsigned)(b / nxy)};
    status = run_block();
  }
  if (status != OK)
    snprintf(message, message_len, "%s (block %llu of %llu in the shuffled order, seed %llu)", L.message.c_str(),
             ran, nblocks, seed);
  return status;
}
