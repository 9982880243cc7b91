"""Our CUDA kernels' source run on the CPU, for their indexing (no GPU here or in CI).

The source (kernels/cuda_q4.py's SOURCE, or a test's own kernel) is compiled by the host's
C++ compiler after each inline-PTX statement is rewritten into a call of a C++ emulation of
that instruction (`PTX` below lists the ones our kernels use); every CUDA thread of a thread
block cluster runs as a host thread (the clusters one after another, or with `coresident` the
whole grid at once: a persistent kernel whose CTAs wait on each other's flags in global
memory, such a wait failing the launch at a deadline); `__syncthreads`, the cluster barrier
and the warp's collectives (ldmatrix, mma.sync, shfl) are barriers; static `__shared__`
variables live in the CTA's shared memory after the dynamic part. The result checks what a
launch writes where, which rows and columns it reads, and its synchronisation's structure —
not the GPU's bits or speed: mma.sync sums its 16 products in float64 here and in an order of
the hardware's own on the GPU, and fp16 arithmetic rounds once as the PTX defines. So tests
compare against float64 references within a tolerance, and two kernels against each other
bit for bit (deterministic here: the same fragments in the same order give the same bits);
tests/kernels/test_gpu.py judges the GPU's bits on the device.

    lib = build(cuda_q4.SOURCE + cuda_q4.CORE)                  # ~10 s, cached by its text
    with emulated(lib): cuda_q4.linear(...)                      # CPU tensors

`emulated` puts the emulator in place of cuda_q4's module loader and launcher for the block,
so the kernels' own host code (plans, grids, shared memory sizes, arguments) runs unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HEADER = r"""
#include <atomic>
#include <chrono>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <memory>
#include <string>
#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>
#include <stdexcept>
using std::min; using std::max;

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n) alignas(n)
#define __CUDA_ARCH__ 900

struct dim3 { unsigned x = 0, y = 0, z = 0; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float __expf(float x) { return std::exp2(x * 1.44269504f); }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }

struct __half { uint16_t x; };
struct alignas(4) __half2 { __half x, y; };
inline __half f2h(double v) { _Float16 h = (_Float16)v; __half r; std::memcpy(&r, &h, 2); return r; }
inline float h2f(__half h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline __half __float2half_rn(float v) { _Float16 h = (_Float16)v; __half r; std::memcpy(&r, &h, 2); return r; }
inline float __half2float(__half h) { return h2f(h); }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline __half2 __low2half2(__half2 h) { return {h.x, h.x}; }
inline __half2 __high2half2(__half2 h) { return {h.y, h.y}; }
inline float2 __half22float2(__half2 h) { return {h2f(h.x), h2f(h.y)}; }
// one rounding: fp16 x fp16 is exact in double, and so is the sum for our operands' range
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return {f2h((double)h2f(a.x) * h2f(b.x) + h2f(c.x)), f2h((double)h2f(a.y) * h2f(b.y) + h2f(c.y))};
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __fmul_rn(float a, float b) { return a * b; }  // (no contraction at -O1 without -ffp-contract)
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }

namespace emu {
using Barrier = std::barrier<>;
struct Warp {
  Warp() : bar(32) {}
  Barrier bar;
  uint64_t slot[32][16];
};
struct Cta {
  std::vector<unsigned char> arena;  // the dynamic shared memory, then the static variables
  Barrier* bar;
  std::vector<Warp*> warps;
  unsigned rank;
  std::mutex m;
  std::vector<std::pair<int, size_t>> statics;  // a static __shared__ variable's offset
  size_t top;
};
struct Cluster {
  std::vector<Cta*> ctas;
  Barrier* bar;
};
inline thread_local dim3 t_thread, t_block;
inline thread_local Cta* t_cta;
inline thread_local Cluster* t_cluster;
inline thread_local std::optional<Barrier::arrival_token> t_token;
inline dim3 g_block_dim, g_grid_dim;

inline unsigned char* smem() { return t_cta->arena.data(); }
constexpr size_t STATIC_SHARED = 64 * 1024;
// a static __shared__ variable (declaration `id`): one per CTA, the first thread to ask places it
template <typename T> inline T& shared_var(int id) {
  Cta* c = t_cta;
  std::lock_guard<std::mutex> g(c->m);
  for (auto& [k, off] : c->statics)
    if (k == id) return *reinterpret_cast<T*>(c->arena.data() + off);
  const size_t off = (c->top + 15) & ~size_t(15);
  if (off + sizeof(T) > c->arena.size()) throw std::runtime_error("static shared memory overflow");
  c->top = off + sizeof(T);
  c->statics.emplace_back(id, off);
  return *reinterpret_cast<T*>(c->arena.data() + off);
}
inline Warp& warp() { return *t_cta->warps[t_thread.x / 32]; }
inline unsigned lane() { return t_thread.x % 32; }
inline unsigned shared_addr(const void* p) {
  const auto d = static_cast<const unsigned char*>(p) - t_cta->arena.data();
  if (d < 0 || (size_t)d >= t_cta->arena.size()) throw std::runtime_error("not a shared address");
  return (unsigned)d;
}
inline unsigned char* shared_ptr(unsigned a) {  // a CTA-local or a mapa'd (rank << 24 | offset) address
  Cta* c = (a >> 24) ? t_cluster->ctas[(a >> 24) - 1] : t_cta;
  const unsigned off = a & 0xFFFFFFu;
  if (off >= c->arena.size()) throw std::runtime_error("shared address out of range");
  return c->arena.data() + off;
}
inline void syncwarp() { warp().bar.arrive_and_wait(); }

// PTX
inline unsigned prmt(unsigned a, unsigned b, unsigned s) {
  const uint64_t v = (uint64_t)b << 32 | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 7u;
    r |= (unsigned)((v >> (8 * sel)) & 0xFFu) << (8 * i);
  }
  return r;
}
inline unsigned lop3(unsigned a, unsigned b, unsigned c, unsigned lut) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) {
    const unsigned idx = ((a >> i) & 1u) << 2 | ((b >> i) & 1u) << 1 | ((c >> i) & 1u);
    r |= ((lut >> idx) & 1u) << i;
  }
  return r;
}
inline __half2 as_h2(unsigned u) { __half2 h; std::memcpy(&h, &u, 4); return h; }
inline unsigned as_u(__half2 h) { unsigned u; std::memcpy(&u, &h, 4); return u; }
inline unsigned sub_f16x2(unsigned a, unsigned b) {
  const __half2 x = as_h2(a), y = as_h2(b);
  return as_u({f2h((double)h2f(x.x) - h2f(y.x)), f2h((double)h2f(x.y) - h2f(y.y))});
}
inline unsigned fma_f16x2(unsigned a, unsigned b, unsigned c) { return as_u(__hfma2(as_h2(a), as_h2(b), as_h2(c))); }
inline float silu_mul(float g, float u) { return g / (1.0f + std::exp2(-g * 1.44269504f)) * u; }

// mma.m16n8k16 row.col f32.f16.f16.f32 (C = D): lane (g, c) holds A (g, 2c..), (g+8, 2c..),
// (g, 2c+8..), (g+8, 2c+8..); B (k 2c.., n g), (k 2c+8.., n g); C / D (g, 2c..), (g+8, 2c..).
// A 32-bit register holds two fp16 elements, the low half first
inline void half_pair(unsigned v, float& lo, float& hi) { const __half2 h = as_h2(v); lo = h2f(h.x); hi = h2f(h.y); }
inline void mma(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2,
                unsigned a3, unsigned b0, unsigned b1) {
  Warp& w = warp();
  const unsigned l = lane();
  uint64_t* s = w.slot[l];
  s[0] = a0; s[1] = a1; s[2] = a2; s[3] = a3; s[4] = b0; s[5] = b1;
  w.bar.arrive_and_wait();
  float A[16][16], B[16][8];
  for (unsigned q = 0; q < 32; ++q) {
    const unsigned g = q / 4, c = q % 4;
    const uint64_t* t = w.slot[q];
    auto put = [&](int r, int k, unsigned v) { half_pair(v, A[r][k], A[r][k + 1]); };
    put(g, 2 * c, t[0]); put(g + 8, 2 * c, t[1]); put(g, 2 * c + 8, t[2]); put(g + 8, 2 * c + 8, t[3]);
    half_pair((unsigned)t[4], B[2 * c][g], B[2 * c + 1][g]);
    half_pair((unsigned)t[5], B[2 * c + 8][g], B[2 * c + 9][g]);
  }
  w.bar.arrive_and_wait();
  const unsigned g = l / 4, c = l % 4;
  auto dot = [&](int r, int n, float acc) {
    double s2 = 0;
    for (int k = 0; k < 16; ++k) s2 += (double)A[r][k] * B[k][n];
    return (float)(s2 + acc);
  };
  d0 = dot(g, 2 * c, d0); d1 = dot(g, 2 * c + 1, d1); d2 = dot(g + 8, 2 * c, d2); d3 = dot(g + 8, 2 * c + 1, d3);
}

// ldmatrix.x4: lanes 8i..8i+7 give matrix i's row addresses; lane l gets row l/4, halves 2(l%4)..
inline void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
  Warp& w = warp();
  const unsigned l = lane();
  w.slot[l][0] = addr;
  w.bar.arrive_and_wait();
  unsigned out[4];
  for (int i = 0; i < 4; ++i) {
    const unsigned row_addr = (unsigned)w.slot[8 * i + l / 4][0];
    std::memcpy(&out[i], shared_ptr(row_addr) + 4 * (l % 4), 4);
  }
  w.bar.arrive_and_wait();
  r0 = out[0]; r1 = out[1]; r2 = out[2]; r3 = out[3];
}
template <typename T> inline T shfl(T v, int src) {
  Warp& w = warp();
  std::memcpy(&w.slot[lane()][0], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &w.slot[src & 31][0], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}
template <typename T> inline T shfl_xor(T v, int m) { return shfl(v, (int)(lane() ^ (unsigned)m)); }
inline unsigned mapa(unsigned a, unsigned rank) { return ((rank + 1) << 24) | (a & 0xFFFFFFu); }
inline void ld_cluster_v4(float& a, float& b, float& c, float& d, unsigned addr) {
  float v[4];
  std::memcpy(v, shared_ptr(addr), 16);
  a = v[0]; b = v[1]; c = v[2]; d = v[3];
}
inline void st_cluster(unsigned addr, float v) { std::memcpy(shared_ptr(addr), &v, 4); }
inline unsigned cluster_rank() { return t_cta->rank; }
inline void cluster_arrive() { t_token.emplace(t_cluster->bar->arrive()); }
inline void cluster_wait() { t_cluster->bar->wait(std::move(*t_token)); t_token.reset(); }
inline void cp_async(unsigned dst, const void* src, int n) { std::memcpy(shared_ptr(dst), src, n); }
// global-memory flags between CTAs (a persistent kernel's counters; a launch with `coresident`
// runs every CTA at once): a load that waits yields the host core first, so spinners let the
// writers run, and a wait past the launch's deadline fails the launch instead of hanging it
// (a flag no CTA sets, or a grid launched a cluster at a time that needed `coresident`)
inline std::chrono::steady_clock::time_point g_deadline;
template <typename A> inline unsigned* gptr(A a) { return (unsigned*)(uintptr_t)(a); }
inline void waiting() {
  std::this_thread::yield();
  if (std::chrono::steady_clock::now() > g_deadline)
    throw std::runtime_error("a wait on a global flag outlived the launch's deadline");
}
template <typename A> inline unsigned ld_acquire(A a) { waiting(); return __atomic_load_n(gptr(a), __ATOMIC_ACQUIRE); }
template <typename A> inline void red_release_add(A a, unsigned v) { __atomic_fetch_add(gptr(a), v, __ATOMIC_RELEASE); }
}  // namespace emu
inline void __nanosleep(unsigned) { std::this_thread::yield(); }

#define threadIdx emu::t_thread
#define blockIdx emu::t_block
#define blockDim emu::g_block_dim
#define gridDim emu::g_grid_dim
#define __syncthreads() (emu::t_cta->bar->arrive_and_wait())
#define __syncwarp(...) emu::syncwarp()
#define __shfl_sync(mask, v, src) emu::shfl(v, src)
#define __shfl_xor_sync(mask, v, m, ...) emu::shfl_xor(v, m)
inline unsigned long __cvta_generic_to_shared(const void* p) { return emu::shared_addr(p); }
"""

LAUNCHER = r"""
typedef void (*Fn)();
static void call(Fn fn, int np, void** p, int ni, const int* iv);

// one host thread per CUDA thread of a cluster, kept for the whole launch: the clusters run one
// after another, each on fresh CTAs (shared memory poisoned) and fresh barriers; with
// `coresident`, all of the grid's clusters at once (a persistent kernel whose CTAs wait on
// each other's flags: up to MAX_CORESIDENT threads in all)
constexpr unsigned MAX_CORESIDENT = 4096;
extern "C" int emu_launch(Fn fn, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                          unsigned smem, unsigned cx, unsigned cy, unsigned cz, int np, void** p,
                          int ni, const int* iv, char* err, int err_len, int coresident,
                          int deadline_s) {
  emu::g_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(deadline_s);
  emu::g_block_dim = {threads, 1, 1};
  emu::g_grid_dim = {gx, gy, gz};
  const unsigned per = cx * cy * cz;
  std::vector<dim3> origins;
  for (unsigned bz = 0; bz < gz; bz += cz)
    for (unsigned by = 0; by < gy; by += cy)
      for (unsigned bx = 0; bx < gx; bx += cx) origins.push_back({bx, by, bz});
  const unsigned groups = coresident ? (unsigned)origins.size() : 1u, n = groups * per * threads;
  if (coresident && n > MAX_CORESIDENT) {
    std::snprintf(err, err_len, "a co-resident grid of %u threads (at most %u)", n, MAX_CORESIDENT);
    return 1;
  }
  struct State {
    emu::Cluster cl;
    std::unique_ptr<emu::Barrier> cbar;
    std::vector<emu::Cta> ctas;
    std::vector<std::unique_ptr<emu::Barrier>> bars;
    std::vector<std::unique_ptr<emu::Warp>> warps;
  };
  auto fresh = [&](State& st) {
    st.cbar.reset(new emu::Barrier(per * threads));
    st.cl.bar = st.cbar.get();
    st.ctas = std::vector<emu::Cta>(per);
    st.bars.clear(); st.warps.clear(); st.cl.ctas.clear();
    for (unsigned r = 0; r < per; ++r) {
      st.ctas[r].arena.assign(smem + 16 + emu::STATIC_SHARED, 0xCD);  // poison: undefined at start
      st.ctas[r].top = smem + 16;
      st.bars.emplace_back(new emu::Barrier(threads));
      st.ctas[r].bar = st.bars.back().get();
      st.ctas[r].rank = r;
      for (unsigned w = 0; w < threads / 32; ++w) {
        st.warps.emplace_back(new emu::Warp());
        st.ctas[r].warps.push_back(st.warps.back().get());
      }
      st.cl.ctas.push_back(&st.ctas[r]);
    }
  };
  std::vector<State> sts(groups);
  std::string failure;
  std::mutex fm;
  size_t current = 0;  // the round's first cluster
  // every thread and the caller: the clusters' state is set before and read after these
  std::barrier<> go(n + 1), done(n + 1);
  std::vector<std::thread> ts;
  for (unsigned g = 0; g < groups; ++g)
    for (unsigned r = 0; r < per; ++r)
      for (unsigned t = 0; t < threads; ++t)
        ts.emplace_back([&, g, r, t] {
        State& st = sts[g];
        for (;;) {
          go.arrive_and_wait();
          if (current == origins.size()) return;
          const dim3 o = origins[current + g];
          emu::t_thread = {t, 0, 0};
          emu::t_block = {o.x + r % cx, o.y + (r / cx) % cy, o.z + r / (cx * cy)};
          emu::t_cta = &st.ctas[r];
          emu::t_cluster = &st.cl;
          try {
            call(fn, np, p, ni, iv);
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> g(fm);
            failure = e.what();
          }
          // a thread that has left no longer holds up its CTA's, warp's or cluster's barriers
          emu::t_cta->warps[t / 32]->bar.arrive_and_drop();
          emu::t_cta->bar->arrive_and_drop();
          st.cl.bar->arrive_and_drop();
          done.arrive_and_wait();
        }
      });
  for (current = 0; current < origins.size(); current += groups) {
    for (State& st : sts) fresh(st);
    go.arrive_and_wait();
    done.arrive_and_wait();
    if (!failure.empty()) break;
  }
  current = origins.size();
  go.arrive_and_wait();
  for (auto& th : ts) th.join();
  if (!failure.empty()) {
    std::snprintf(err, err_len, "%s", failure.c_str());
    return 1;
  }
  return 0;
}
"""

# each inline-PTX instruction our kernels use → a C++ statement over its operands (o: their
# C++ expressions by PTX operand, %0 first)
PTX = {
    "prmt.b32": lambda o: f"{o[0]} = emu::prmt({o[1]}, {o[2]}, {o[3]});",
    "lop3.b32": lambda o: f"{o[0]} = emu::lop3({o[1]}, {o[2]}, {o[3]}, {o[4]});",
    "sub.f16x2": lambda o: f"{o[0]} = emu::sub_f16x2({o[1]}, {o[2]});",
    "fma.rn.f16x2": lambda o: f"{o[0]} = emu::fma_f16x2({o[1]}, {o[2]}, {o[3]});",
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32":
        lambda o: f"emu::mma({', '.join(o[0])}, {', '.join(o[1])}, {', '.join(o[2])});",
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16": lambda o: f"emu::ldmatrix_x4({', '.join(o[0])}, {o[1]});",
    "mapa.shared::cluster.u32": lambda o: f"{o[0]} = emu::mapa({o[1]}, {o[2]});",
    "ld.shared::cluster.v4.f32": lambda o: f"emu::ld_cluster_v4({', '.join(o[0])}, {o[1]});",
    "st.shared::cluster.f32": lambda o: f"emu::st_cluster({o[0]}, {o[1]});",
    "mov.u32": lambda o: f"{o[0]} = emu::cluster_rank();",
    "barrier.cluster.arrive.release.aligned": lambda o: "emu::cluster_arrive();",
    "barrier.cluster.wait.acquire.aligned": lambda o: "emu::cluster_wait();",
    "griddepcontrol.wait": lambda o: ";",
    "griddepcontrol.launch_dependents": lambda o: ";",
    "cp.async.cg.shared.global": lambda o: f"emu::cp_async({o[0]}, {o[1]}, {o[2]});",
    "cp.async.commit_group": lambda o: ";",
    "cp.async.wait_group": lambda o: ";",
    "ld.acquire.gpu.global.u32": lambda o: f"{o[0]} = emu::ld_acquire({o[1]});",
    "red.release.gpu.global.add.u32": lambda o: f"emu::red_release_add({o[0]}, {o[1]});",
    "trap": lambda o: 'throw std::runtime_error("trap")',
}


def _split_top(s: str, sep: str) -> list[str]:
    """s split at sep outside parentheses, brackets and string literals."""
    out, depth, cur, quote, i = [], 0, "", False, 0
    while i < len(s):
        ch = s[i]
        if ch == '"' and (i == 0 or s[i - 1] != "\\"):
            quote = not quote
        elif not quote:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif depth == 0 and s.startswith(sep, i):
                out.append(cur)
                cur, i = "", i + len(sep)
                continue
        cur += ch
        i += 1
    return out + [cur]


def _operand(tok: str, exprs: list[str]):
    tok = tok.strip()
    if tok.startswith("{"):
        return [_operand(t, exprs) for t in tok.strip("{}").split(",")]
    if tok.startswith("["):
        return _operand(tok.strip("[]"), exprs)
    m = re.fullmatch(r"%(\d+)", tok)
    if m:
        return exprs[int(m.group(1))]
    return tok  # an immediate (or a special register, %%name)


def _rewrite(stmt: str) -> str:
    """One `asm [volatile](...)` statement (without its `;`) → C++."""
    body = stmt[stmt.index("(") + 1: stmt.rindex(")")]
    parts = _split_top(body, ":")
    text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', parts[0])).replace("\\n", "\n")
    exprs = []
    for side in parts[1:3]:
        for op in _split_top(side, ","):
            m = re.match(r'\s*"[=+]?[a-z]"\s*\((.*)\)\s*$', op, re.S)
            if m:
                exprs.append(m.group(1).strip())
    if "ex2.approx" in text:  # silu_mul's block: %0 = %1 / (1 + 2^(-%1 log2 e)) * %2
        return f"{exprs[0]} = emu::silu_mul({exprs[1]}, {exprs[2]})"
    inst = text.strip().rstrip(";").strip()
    mnemonic, _, rest = inst.partition(" ")
    if mnemonic not in PTX:
        raise ValueError(f"cuda_emu: no emulation for PTX {inst!r}")
    ops = [_operand(t, exprs) for t in _split_top(rest, ",")] if rest.strip() else []
    return PTX[mnemonic](ops).rstrip(";")


def translate(source: str) -> str:
    """The CUDA source as host C++: inline PTX rewritten, the dynamic shared memory the CTA's."""
    source = source.replace("#include <cuda_fp16.h>", "")
    source = re.sub(r"extern __shared__ __align__\(16\) unsigned char (\w+)\[\];",
                    r"unsigned char* \1 = emu::smem();", source)
    ids = iter(range(1 << 30))

    def statics(m: re.Match) -> str:  # `__shared__ T a[N], b[M];` → a reference a CTA each
        out = []
        for decl in m.group(2).split(","):
            name, dims = re.fullmatch(r"\s*(\w+)((?:\[[^\]]*\])*)\s*", decl).groups()
            out.append(f"auto& {name} = emu::shared_var<{m.group(1)}{dims}>({next(ids)});")
        return " ".join(out)

    source = re.sub(r"__shared__\s+(\w+)\s+([^;]+);", statics, source)
    out, i = [], 0
    for m in re.finditer(r"\basm\s*(volatile\s*)?\(", source):
        if m.start() < i:
            continue
        depth, j = 0, m.end() - 1
        quote = False
        while True:  # the statement's closing parenthesis
            ch = source[j]
            if ch == '"' and source[j - 1] != "\\":
                quote = not quote
            elif not quote and ch == "(":
                depth += 1
            elif not quote and ch == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append(source[i:m.start()])
        out.append(_rewrite(source[m.start():j + 1]))
        i = j + 1
    out.append(source[i:])
    return "".join(out)


def _caller(max_ptrs: int = 10, max_ints: int = 16) -> str:
    """call(): fn with np pointers then ni ints (every entry's parameters are so ordered; all
    are INTEGER-class arguments, passed alike whatever their pointee)."""
    cases = []
    for a in range(1, max_ptrs + 1):
        for b in range(max_ints + 1):
            params = ", ".join(["void*"] * a + ["int"] * b)
            args = ", ".join([f"p[{k}]" for k in range(a)] + [f"iv[{k}]" for k in range(b)])
            cases.append(f"  if (np == {a} && ni == {b}) return ((void (*)({params}))fn)({args});")
    return ("static void call(Fn fn, int np, void** p, int ni, const int* iv) {\n"
            + "\n".join(cases) + '\n  throw std::runtime_error("cuda_emu: too many arguments");\n}\n')


def available() -> bool:
    """Whether the host has the C++20 compiler the emulator builds with."""
    return shutil.which("g++") is not None


def build(source: str) -> ctypes.CDLL:
    """The source compiled for the host (cached by its text in the temp directory)."""
    code = HEADER + translate(source) + LAUNCHER + _caller()
    key = hashlib.sha256(code.encode()).hexdigest()[:16]
    d = Path(tempfile.gettempdir()) / "fedserve-cuda-emu"
    d.mkdir(exist_ok=True)
    lib = d / f"emu_{key}.so"
    if not lib.exists():
        src = d / f"emu_{key}.cpp"
        src.write_text(code)
        tmp = d / f"emu_{key}.{os.getpid()}.so"
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                            "-pthread", "-w",
                            "-o", str(tmp), str(src)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"cuda_emu: the host build failed:\n{r.stderr[-4000:]}")
        tmp.replace(lib)
    so = ctypes.CDLL(str(lib))
    so.emu_launch.restype = ctypes.c_int
    return so


def launch(lib: ctypes.CDLL, name: bytes | str, grid, threads: int, smem: int, cluster,
           tensors, ints, coresident: bool = False, deadline_s: int = 120) -> None:
    """name<<<grid, threads, smem>>> over CPU tensors, clusters of `cluster` CTAs; coresident:
    every CTA at once (a persistent kernel's, whose CTAs wait on each other), else a cluster
    at a time. A wait on a global flag (ld.acquire) past deadline_s seconds from the
    launch's start fails it."""
    fn = ctypes.cast(getattr(lib, name.decode() if isinstance(name, bytes) else name), ctypes.c_void_p)
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    iv = (ctypes.c_int * max(1, len(ints)))(*ints)
    err = ctypes.create_string_buffer(512)
    if lib.emu_launch(fn, *[ctypes.c_uint(v) for v in grid], ctypes.c_uint(threads),
                      ctypes.c_uint(smem), *[ctypes.c_uint(v) for v in cluster],
                      len(tensors), ptrs, len(ints), iv, err, 512, int(coresident),
                      int(deadline_s)):
        raise RuntimeError(f"cuda_emu: {name!r}: {err.value.decode()}")


@contextlib.contextmanager
def emulated(lib: ctypes.CDLL, clusters: dict | None = None, coresident: tuple = ()):
    """cuda_q4's module loader, launcher and operand check replaced by the emulator (over
    `lib`) for the block; clusters: {entry name: its __cluster_dims__} for the entries
    launched as clusters; coresident: the entries whose CTAs all run at once (persistent)."""
    import pytest
    import torch

    from kernels import cuda_q4

    class Fns(dict):
        def __missing__(self, key):
            return key.decode() if isinstance(key, bytes) else key

    def launch_(cuda, fn, grid, threads, smem, tensors, ints):
        launch(lib, fn, grid, threads, smem, (clusters or {}).get(fn, (1, 1, 1)), tensors, ints,
               coresident=fn in coresident)

    def check(x, out, residual):  # cuda_q4._check without its CUDA-only rule
        for t in (x, out) + ((residual,) if residual is not None else ()):
            if t.dtype != torch.float32 or t.stride(1) != 1 or t.stride(0) % 2:
                raise ValueError("cuda_emu: x, out and residual float32 rows, even strides")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_q4, "_functions", lambda device: (None, Fns()))
        mp.setattr(cuda_q4, "_launch", launch_)
        mp.setattr(cuda_q4, "_check", check)
        yield
