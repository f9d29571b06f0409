// Tidewire's aggregation kernels, compiled at run time by NVRTC (see
// kernels.rs). No headers: bf16 and f16 are widened by hand, exactly, so the
// CPU reference (tidewire_gpu::cpu) produces the same bits.
//
// Every element is summed in input order: acc + x0 + x1 + ... . With
// --fmad=false (the deterministic mode) no multiply-add is contracted, so the
// apply kernels match the CPU's separate multiply and add as well.

typedef unsigned short u16;
typedef unsigned long long u64;

#define MAX_INPUTS 32

struct Inputs {
    u64 p[MAX_INPUTS];
};

// Kinds: 0 = f32, 1 = bf16, 2 = f16.
template <int K> __device__ __forceinline__ float widen(u16 h);
template <> __device__ __forceinline__ float widen<1>(u16 h) { return __uint_as_float(((unsigned)h) << 16); }
template <> __device__ __forceinline__ float widen<2>(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

template <int K> __device__ __forceinline__ float load1(u64 p, u64 i);
template <> __device__ __forceinline__ float load1<0>(u64 p, u64 i) { return ((const float*)p)[i]; }
template <> __device__ __forceinline__ float load1<1>(u64 p, u64 i) { return widen<1>(((const u16*)p)[i]); }
template <> __device__ __forceinline__ float load1<2>(u64 p, u64 i) { return widen<2>(((const u16*)p)[i]); }

// Four elements from index 4*i: one 16-byte load for f32, one 8-byte load for 16-bit types.
template <int K> __device__ __forceinline__ float4 load4(u64 p, u64 i);
template <> __device__ __forceinline__ float4 load4<0>(u64 p, u64 i) { return ((const float4*)p)[i]; }
template <int K> __device__ __forceinline__ float4 load4h(u64 p, u64 i) {
    uint2 v = ((const uint2*)p)[i];
    return make_float4(widen<K>((u16)(v.x & 0xffff)), widen<K>((u16)(v.x >> 16)),
                       widen<K>((u16)(v.y & 0xffff)), widen<K>((u16)(v.y >> 16)));
}
template <> __device__ __forceinline__ float4 load4<1>(u64 p, u64 i) { return load4h<1>(p, i); }
template <> __device__ __forceinline__ float4 load4<2>(u64 p, u64 i) { return load4h<2>(p, i); }

// acc[i] = (init ? x0[i] : acc[i] + x0[i]) + x1[i] + ... ; vec: every pointer is
// aligned for 4-element loads.
template <int K>
__device__ void sum_impl(float* acc, const Inputs& in, int np, u64 n, int init, int vec) {
    u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)blockDim.x * gridDim.x;
    u64 done = 0;
    if (vec) {
        u64 n4 = n / 4;
        for (u64 i = tid; i < n4; i += stride) {
            float4 a;
            int p = 0;
            if (init) {
                a = load4<K>(in.p[0], i);
                p = 1;
            } else {
                a = ((float4*)acc)[i];
            }
            for (; p < np; ++p) {
                float4 x = load4<K>(in.p[p], i);
                a.x = a.x + x.x;
                a.y = a.y + x.y;
                a.z = a.z + x.z;
                a.w = a.w + x.w;
            }
            ((float4*)acc)[i] = a;
        }
        done = n4 * 4;
    }
    for (u64 i = done + tid; i < n; i += stride) {
        float a;
        int p = 0;
        if (init) {
            a = load1<K>(in.p[0], i);
            p = 1;
        } else {
            a = acc[i];
        }
        for (; p < np; ++p) a = a + load1<K>(in.p[p], i);
        acc[i] = a;
    }
}

extern "C" __global__ void tw_sum_f32(float* acc, Inputs in, int np, u64 n, int init, int vec) {
    sum_impl<0>(acc, in, np, n, init, vec);
}
extern "C" __global__ void tw_sum_bf16(float* acc, Inputs in, int np, u64 n, int init, int vec) {
    sum_impl<1>(acc, in, np, n, init, vec);
}
extern "C" __global__ void tw_sum_f16(float* acc, Inputs in, int np, u64 n, int init, int vec) {
    sum_impl<2>(acc, in, np, n, init, vec);
}

// Arrival-order accumulation (the non-deterministic mode): concurrent streams
// add their inputs with atomics, in whatever order the hardware runs them.
extern "C" __global__ void tw_atomic_add_f32(float* acc, const float* x, u64 n) {
    u64 stride = (u64)blockDim.x * gridDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) atomicAdd(acc + i, x[i]);
}

extern "C" __global__ void tw_scale_f32(float* x, float s, u64 n) {
    u64 stride = (u64)blockDim.x * gridDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = x[i] * s;
}

// tidewire_gpu::cpu::apply, fused: op 0 = sum (w = a), 1 = mean (w = a*inv),
// 2 = SGD without momentum, 3 = SGD with momentum:
//   v = mu*v + lr*(a*inv + wd*w); w -= v.
extern "C" __global__ void tw_apply_f32(int op, float inv, float lr, float mu, float wd, const float* acc, float* w,
                                        float* v, u64 n) {
    u64 stride = (u64)blockDim.x * gridDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float a = acc[i];
        if (op == 0) {
            w[i] = a;
        } else if (op == 1) {
            w[i] = a * inv;
        } else if (op == 2) {
            float wi = w[i];
            w[i] = wi - lr * (a * inv + wd * wi);
        } else {
            float wi = w[i];
            float vi = mu * v[i] + lr * (a * inv + wd * wi);
            v[i] = vi;
            w[i] = wi - vi;
        }
    }
}
