// SiLU of the gate times the up projection, elementwise, as the CPU's `numerics::swiglu`:
// `g / (1 + exp(-g)) * u` (the precise `expf`; the CPU's ggml exponential is within 1.5 ulp of it).

extern "C" __global__ void swiglu(const float* gate, const float* up, float* out, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    out[i] = (g / (1.0f + expf(0.0f - g))) * up[i];
}
